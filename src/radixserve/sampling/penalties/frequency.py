"""OpenAI frequency penalty: ``logit -= frequency_penalty * count`` of the token in the output."""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import OutputPenalizer


class FrequencyPenalizer(OutputPenalizer):
    """Discourages tokens in proportion to how often the request has already generated them."""

    FIELD = "frequency_penalty"

    @staticmethod
    def weight(output_counts: torch.Tensor) -> torch.Tensor:
        return output_counts
