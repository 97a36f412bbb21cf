"""The penalizer contract, the batch view every penalizer reads, and the base of the two
additive OpenAI penalties.

A penalizer is one logit adjustment (frequency, presence, repetition, min_new_tokens). The batch is
rebuilt from the scheduler's requests every step, so penalizers hold no state between steps: each
one is constructed from a fresh ``PenaltyInputs`` and applied once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch

from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class PenaltyInputs:
    """Per-request parameters and token history of one batch, in batch order."""

    params: Sequence[SamplingParams]
    output_ids: Sequence[Sequence[int]]  # tokens generated so far
    input_ids: Sequence[Sequence[int]]  # prompt tokens
    eos_token_ids: Sequence[int]
    vocab_size: int
    device: torch.device

    @property
    def batch_size(self) -> int:
        return len(self.params)

    @cached_property
    def output_counts(self) -> torch.Tensor:
        """``[bs, vocab]`` float32: how often each token was generated; shared by penalizers."""
        rows = enumerate(self.output_ids)
        return count_tokens(rows, self.batch_size, self.vocab_size, self.device)

    def per_request(self, values: list[float]) -> torch.Tensor:
        """A ``[bs, 1]`` float32 column that broadcasts over the vocabulary."""
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)


def count_tokens(
    rows: Iterable[tuple[int, Sequence[int]]],
    batch_size: int,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Count tokens per row into a ``[batch_size, vocab_size]`` float32 tensor.

    ``rows`` yields ``(row, tokens)``; a row may appear more than once (prompt and output). Ids
    outside the vocabulary are ignored, as transformers does, since the model cannot emit them.
    """
    row_ids: list[int] = []
    arrays: list[np.ndarray] = []
    for row, tokens in rows:
        row_ids.append(row)
        arrays.append(np.asarray(tokens, dtype=np.int64))
    counts = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device)
    if not arrays:
        return counts
    # numpy flattens Python int lists several times faster than torch.tensor does.
    tokens = np.concatenate(arrays)
    token_rows = np.repeat(np.asarray(row_ids, dtype=np.int64), [len(a) for a in arrays])
    valid = (tokens >= 0) & (tokens < vocab_size)
    flat = torch.from_numpy(token_rows[valid] * vocab_size + tokens[valid]).to(device)
    counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts


class Penalizer(ABC):
    """One logit adjustment over a batch.

    Contract: ``is_required(inputs)`` is cheap and says whether any request of the batch uses this
    penalty; only then is the penalizer constructed, as ``cls(inputs)``. ``apply`` edits the
    ``[bs, vocab]`` float32 logits in place and leaves rows that do not use the penalty unchanged.
    """

    @staticmethod
    @abstractmethod
    def is_required(inputs: PenaltyInputs) -> bool: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> None: ...


class OutputPenalizer(Penalizer):
    """OpenAI's additive penalties: ``logit -= penalty * weight`` of each token the request has
    generated, where ``penalty`` is the request's ``FIELD`` sampling parameter (0 means unused)
    and ``weight(output_counts)`` is what a subclass makes of how often each token came out.

    The frequency and presence penalties differ only in those two, so they share the rest here.
    """

    FIELD: ClassVar[str]

    @classmethod
    def is_required(cls, inputs: PenaltyInputs) -> bool:
        return any(getattr(p, cls.FIELD) != 0.0 for p in inputs.params)

    def __init__(self, inputs: PenaltyInputs) -> None:
        penalties = inputs.per_request([getattr(p, self.FIELD) for p in inputs.params])
        self._delta = penalties * self.weight(inputs.output_counts)

    @staticmethod
    @abstractmethod
    def weight(output_counts: torch.Tensor) -> torch.Tensor:
        """``[bs, vocab]``: what the penalty is multiplied by, per token."""

    def apply(self, logits: torch.Tensor) -> None:
        logits.sub_(self._delta)
