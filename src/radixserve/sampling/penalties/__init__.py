"""Logit penalties, one small class each, composed by ``PenaltyOrchestrator``."""

from radixserve.sampling.penalties.base import Penalizer, PenaltyInputs
from radixserve.sampling.penalties.frequency import FrequencyPenalizer
from radixserve.sampling.penalties.min_new_tokens import MinNewTokensPenalizer
from radixserve.sampling.penalties.orchestrator import PENALIZERS, PenaltyOrchestrator
from radixserve.sampling.penalties.presence import PresencePenalizer
from radixserve.sampling.penalties.repetition import RepetitionPenalizer

__all__ = [
    "PENALIZERS",
    "FrequencyPenalizer",
    "MinNewTokensPenalizer",
    "Penalizer",
    "PenaltyInputs",
    "PenaltyOrchestrator",
    "PresencePenalizer",
    "RepetitionPenalizer",
]
