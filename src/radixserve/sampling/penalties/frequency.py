"""OpenAI frequency penalty: ``logit -= frequency_penalty * count`` of the token in the output."""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import Penalizer, PenaltyInputs


class FrequencyPenalizer(Penalizer):
    """Discourages tokens in proportion to how often the request has already generated them."""

    @staticmethod
    def is_required(inputs: PenaltyInputs) -> bool:
        return any(p.frequency_penalty != 0.0 for p in inputs.params)

    def __init__(self, inputs: PenaltyInputs) -> None:
        penalties = inputs.per_request([p.frequency_penalty for p in inputs.params])
        self._delta = penalties * inputs.output_counts

    def apply(self, logits: torch.Tensor) -> None:
        logits.sub_(self._delta)
