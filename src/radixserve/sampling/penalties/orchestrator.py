"""Builds the penalizers a batch needs and applies them in one fixed order."""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import Penalizer, PenaltyInputs
from radixserve.sampling.penalties.frequency import FrequencyPenalizer
from radixserve.sampling.penalties.min_new_tokens import MinNewTokensPenalizer
from radixserve.sampling.penalties.presence import PresencePenalizer
from radixserve.sampling.penalties.repetition import RepetitionPenalizer

# Order matters: the multiplicative repetition penalty sees the logits as transformers would,
# the additive OpenAI penalties follow, and the min_new_tokens ban comes last so that nothing
# after it can lift a banned token off -inf.
PENALIZERS: tuple[type[Penalizer], ...] = (
    RepetitionPenalizer,
    FrequencyPenalizer,
    PresencePenalizer,
    MinNewTokensPenalizer,
)


class PenaltyOrchestrator:
    """The penalizers some request of the batch uses, applied in ``PENALIZERS`` order."""

    def __init__(self, penalizers: list[Penalizer]) -> None:
        self.penalizers = penalizers

    @classmethod
    def build(cls, inputs: PenaltyInputs) -> PenaltyOrchestrator | None:
        """Return an orchestrator, or ``None`` when no request of the batch uses any penalty."""
        penalizers = [p(inputs) for p in PENALIZERS if p.is_required(inputs)]
        return cls(penalizers) if penalizers else None

    def apply(self, logits: torch.Tensor) -> None:
        """Apply every penalizer to ``[bs, vocab]`` float32 logits, in place."""
        for penalizer in self.penalizers:
            penalizer.apply(logits)
