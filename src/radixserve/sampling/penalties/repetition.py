"""Repetition penalty (CTRL paper, transformers semantics) over prompt and output tokens.

A token already seen in the prompt or the output has its logit divided by the penalty when
positive and multiplied by it otherwise, so a penalty above 1 always makes it less likely.
"""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import Penalizer, PenaltyInputs, count_tokens


class RepetitionPenalizer(Penalizer):
    """Scales the logits of seen tokens; rows with penalty 1 are left as they are."""

    @staticmethod
    def is_required(inputs: PenaltyInputs) -> bool:
        return any(p.repetition_penalty != 1.0 for p in inputs.params)

    def __init__(self, inputs: PenaltyInputs) -> None:
        rows = [i for i, p in enumerate(inputs.params) if p.repetition_penalty != 1.0]
        # Only rows that use the penalty pay for flattening their (possibly long) prompts.
        history = [(i, inputs.input_ids[i]) for i in rows]
        history += [(i, inputs.output_ids[i]) for i in rows]
        self._seen = count_tokens(history, inputs.batch_size, inputs.vocab_size, inputs.device) > 0
        self._penalties = inputs.per_request([p.repetition_penalty for p in inputs.params])

    def apply(self, logits: torch.Tensor) -> None:
        penalized = torch.where(logits > 0, logits / self._penalties, logits * self._penalties)
        logits.copy_(torch.where(self._seen, penalized, logits))
