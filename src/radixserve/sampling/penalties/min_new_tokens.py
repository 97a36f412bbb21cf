"""min_new_tokens: forbid EOS and the request's stop_token_ids until enough tokens are out.

``ignore_eos`` is unrelated: it tells the scheduler not to stop on EOS and masks nothing here.
"""

from __future__ import annotations

import torch

from radixserve.sampling.penalties.base import Penalizer, PenaltyInputs


class MinNewTokensPenalizer(Penalizer):
    """Sets the logits of ending tokens to -inf for requests still below ``min_new_tokens``."""

    @staticmethod
    def is_required(inputs: PenaltyInputs) -> bool:
        pairs = zip(inputs.params, inputs.output_ids, strict=True)
        return any(len(out) < p.min_new_tokens for p, out in pairs)

    def __init__(self, inputs: PenaltyInputs) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, out) in enumerate(zip(inputs.params, inputs.output_ids, strict=True)):
            if len(out) >= p.min_new_tokens:
                continue
            # Ids were validated upstream; an out-of-range one is skipped, not a crash here.
            ends = (*inputs.eos_token_ids, *p.stop_token_ids)
            banned = sorted({t for t in ends if 0 <= t < inputs.vocab_size})
            rows.extend([i] * len(banned))
            cols.extend(banned)
        self._rows = torch.tensor(rows, dtype=torch.int64, device=inputs.device)
        self._cols = torch.tensor(cols, dtype=torch.int64, device=inputs.device)

    def apply(self, logits: torch.Tensor) -> None:
        banned = torch.tensor(float("-inf"), device=logits.device)
        logits.index_put_((self._rows, self._cols), banned)
