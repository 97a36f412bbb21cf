"""OpenAI presence penalty: ``logit -= presence_penalty`` once the token appears in the output."""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import OutputPenalizer


class PresencePenalizer(OutputPenalizer):
    """Discourages every token the request has generated at least once, by a flat amount."""

    FIELD = "presence_penalty"

    @staticmethod
    def weight(output_counts: torch.Tensor) -> torch.Tensor:
        return output_counts > 0
