"""``SamplingBatchInfo``: the per-request sampling parameters of one step, as batched tensors.

Data flow: ``SamplingParams`` (one per request, on ``Req``) → ``SamplingBatchInfo.from_params``
(called by ``ScheduleBatch.to_forward_batch`` every step, carried on ``ForwardBatch``) →
``Sampler`` (``layers/sampler.py``), which turns ``[bs, vocab]`` logits into next tokens.

It is rebuilt from scratch every step instead of being updated incrementally, so it must stay
cheap: a batch that uses no penalty, logit bias or pending min_new_tokens costs four small
``[bs]`` tensors and a few passes over the request list; ``[bs, vocab]`` tensors exist only for
batches that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixserve.sampling.penalties import PenaltyInputs, PenaltyOrchestrator
from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class GrammarMask:
    """The tokens constrained requests may sample next (``radixserve.constrained``).

    ``bitmask`` is ``[bs, ceil(vocab / 32)]`` int32 on the CPU (a set bit allows a token);
    ``apply(logits, bitmask, rows)`` sets the forbidden logits of ``rows`` to ``-inf``.
    """

    bitmask: torch.Tensor
    rows: list[int]
    apply: Callable[[torch.Tensor, torch.Tensor, list[int]], None]

    def apply_backend(self, logits: torch.Tensor) -> None:
        """The grammar backend's own ``apply``, on any device (the sampler's ``TokenBitmask``
        takes radixserve's kernel instead where it has one)."""
        self.apply(logits, self.bitmask, self.rows)


# (mask, logits): sets the forbidden logits of the mask's rows to -inf, in place
MaskFn = Callable[[GrammarMask, torch.Tensor], None]


class SeededRow(NamedTuple):
    """A sampled (non-greedy) row with a ``sampling_seed``; ``step`` = its output length so far."""

    index: int
    seed: int
    step: int


@dataclass
class SamplingBatchInfo:
    """Batched sampling parameters of one step; rows are in batch order.

    Greedy rows (temperature 0 or top_k 1) are stored with temperature 1 and top_k 1 so that the
    sampler's division is safe and ``top_ks == 1`` marks them.
    """

    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64, vocab_size when disabled, 1 for greedy rows
    min_ps: torch.Tensor  # [bs] float32
    vocab_size: int
    is_all_greedy: bool
    need_top_p_top_k: bool  # some sampled row filters by top_k or top_p
    need_min_p: bool  # some sampled row filters by min_p
    logit_bias: torch.Tensor | None = None  # [bs, vocab] float32, only if a request has a bias
    penalties: PenaltyOrchestrator | None = None  # also applies the min_new_tokens ban
    seeded_rows: tuple[SeededRow, ...] = ()
    grammar_mask: GrammarMask | None = None  # only if a request is grammar-constrained

    @property
    def batch_size(self) -> int:
        return int(self.top_ks.shape[0])

    @property
    def modifies_logits(self) -> bool:
        """Whether ``process_logits`` changes anything (a logit bias, a penalty or a grammar)."""
        return (
            self.logit_bias is not None
            or self.penalties is not None
            or self.grammar_mask is not None
        )

    @property
    def only_grammar_mask(self) -> bool:
        """Whether the grammar mask is all ``process_logits`` would apply."""
        return self.grammar_mask is not None and self.logit_bias is None and self.penalties is None

    def process_logits(
        self,
        logits: torch.Tensor,
        in_place: bool = False,
        apply_mask: MaskFn = GrammarMask.apply_backend,
    ) -> torch.Tensor:
        """Apply the logit bias, then the penalties and the min_new_tokens ban, then the
        grammar mask (with ``apply_mask``: the sampler's device kernel, or the backend's own).

        Returns ``logits`` itself when the batch has none of them, else a new tensor: the caller's
        logits are not modified (logprobs are taken from them raw), unless ``in_place`` allows
        it (and no penalty needs the raw logits to fall back to). A row whose every token got
        banned by the penalties would give NaN probabilities, so it falls back to its
        unprocessed logits; the grammar mask comes last and always holds (where it conflicts
        with the min_new_tokens ban, say a complete JSON value that only EOS may follow, the
        grammar wins).
        """
        if not self.modifies_logits:
            return logits
        if in_place and self.penalties is None:
            if self.logit_bias is not None:
                logits += self.logit_bias
            if self.grammar_mask is not None:
                apply_mask(self.grammar_mask, logits)
            return logits
        processed = logits + self.logit_bias if self.logit_bias is not None else logits.clone()
        if self.penalties is not None:
            self.penalties.apply(processed)
            banned_all = torch.isneginf(processed).all(dim=-1, keepdim=True)
            processed = torch.where(banned_all, logits, processed)
        if self.grammar_mask is not None:
            apply_mask(self.grammar_mask, processed)
            if self.penalties is not None:
                # The min_new_tokens ban may forbid all the grammar allows (only EOS is left).
                empty = torch.isneginf(processed).all(dim=-1, keepdim=True)
                if bool(empty.any()):
                    allowed = logits.clone()
                    apply_mask(self.grammar_mask, allowed)
                    processed = torch.where(empty, allowed, processed)
        return processed

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        input_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        grammar_mask: GrammarMask | None = None,
    ) -> SamplingBatchInfo:
        """Batch the parameters of ``params[i]`` with its prompt ``input_ids[i]`` and the tokens it
        has generated so far ``output_ids[i]`` (the lists are read, never copied whole)."""
        assert len(params) == len(output_ids) == len(input_ids), "ragged batch"
        device = torch.device(device)
        temperatures: list[float] = []
        top_ks: list[int] = []
        seeded: list[SeededRow] = []
        is_all_greedy = True
        need_top_p_top_k = need_min_p = uses_bias = uses_penalty = False
        for i, (p, out) in enumerate(zip(params, output_ids, strict=True)):
            uses_bias = uses_bias or bool(p.logit_bias)
            uses_penalty = uses_penalty or _penalizes(p, len(out))
            if p.is_greedy:
                temperatures.append(1.0)
                top_ks.append(1)
                continue
            top_k = vocab_size if p.top_k < 0 else min(p.top_k, vocab_size)
            temperatures.append(p.temperature)
            top_ks.append(top_k)
            is_all_greedy = False
            need_top_p_top_k = need_top_p_top_k or top_k < vocab_size or p.top_p < 1.0
            need_min_p = need_min_p or p.min_p > 0.0
            if p.sampling_seed is not None:
                seeded.append(SeededRow(i, p.sampling_seed, len(out)))

        penalties = None
        if uses_penalty:
            inputs = PenaltyInputs(params, output_ids, input_ids, eos_token_ids, vocab_size, device)
            penalties = PenaltyOrchestrator.build(inputs)
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            vocab_size=vocab_size,
            is_all_greedy=is_all_greedy,
            need_top_p_top_k=need_top_p_top_k,
            need_min_p=need_min_p,
            logit_bias=_dense_logit_bias(params, vocab_size, device) if uses_bias else None,
            penalties=penalties,
            seeded_rows=tuple(seeded),
            grammar_mask=grammar_mask,
        )


def _penalizes(params: SamplingParams, num_output_ids: int) -> bool:
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or num_output_ids < params.min_new_tokens
    )


def reads_output_ids(params: SamplingParams, num_output_ids: int) -> bool:
    """Whether sampling the next token depends on the tokens generated so far: the penalties
    and the ``min_new_tokens`` ban count them, a seeded generator's stream is indexed by their
    number. (The overlap schedule plans a step before the previous step's token is known.)"""
    return _penalizes(params, num_output_ids) or params.sampling_seed is not None


def _dense_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[bs, vocab]`` additive bias; ids were validated upstream, out-of-range ones are skipped."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            if 0 <= token < vocab_size:
                rows.append(i)
                cols.append(token)
                values.append(value)
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    index = torch.tensor([rows, cols], dtype=torch.int64, device=device)
    bias[index[0], index[1]] = torch.tensor(values, dtype=torch.float32, device=device)
    return bias
