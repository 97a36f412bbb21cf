"""OpenAI presence penalty: ``logit -= presence_penalty`` once the token appears in the output."""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import Penalizer, PenaltyInputs


class PresencePenalizer(Penalizer):
    """Discourages every token the request has generated at least once, by a flat amount."""

    @staticmethod
    def is_required(inputs: PenaltyInputs) -> bool:
        return any(p.presence_penalty != 0.0 for p in inputs.params)

    def __init__(self, inputs: PenaltyInputs) -> None:
        penalties = inputs.per_request([p.presence_penalty for p in inputs.params])
        self._delta = penalties * (inputs.output_counts > 0)

    def apply(self, logits: torch.Tensor) -> None:
        logits.sub_(self._delta)
