"""Turns next-token logits into next tokens, plus the logprobs the request asked for.

Pipeline of ``Sampler.__call__`` over ``[bs, vocab]`` logits in the model's dtype:

0. a greedy batch without logprobs, bias or penalties takes its argmax right there (upcasting
   cannot change which entry is largest), after its grammar mask if it has one (applied in
   place, in the model's dtype); anything else is upcast to float32 first;
1. logit bias, then penalties and the min_new_tokens ban, then the grammar mask of constrained
   requests (``SamplingBatchInfo.process_logits``), on a copy when logprobs are asked for (they
   are taken from the raw logits), else in place;
2. all rows greedy → argmax (``GreedyArgmax``), no softmax;
3. otherwise divide by temperature, softmax, zero out what top_k / top_p / min_p filter, and
   draw by inverting each row's cumulative distribution at one uniform number per row (what
   ``torch.multinomial`` does, without its errors on degenerate rows or its cost on CPU); scaling
   the uniform by the remaining mass samples the renormalised distribution without a division.
   Unseeded rows take their uniform from the global generator; a row with a ``sampling_seed`` from
   its own ``torch.Generator`` seeded by (seed, output length), so its token depends only on that
   and its own logits, never on the rest of the batch. Greedy rows take the argmax;
4. logprobs come from ``log_softmax`` of the raw logits, so they match transformers (also for
   grammar-constrained requests: the model's own probability of the token it was allowed).

``input_logprobs`` does the same for the extra rows an EXTEND batch computes for prompt
positions (``ForwardBatch`` explains their layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import CustomOp
from radixserve.sampling.sampling_batch_info import GrammarMask, SamplingBatchInfo, SeededRow

_MASK64 = (1 << 64) - 1


@dataclass
class InputLogprobs:
    """One request's logprobs of the prompt positions an EXTEND step computed, in order."""

    values: list[float]  # logprob of each scored prompt token
    top: list[list[tuple[int, float]]] | None = None  # with top_logprobs_num
    token_ids: list[list[float]] | None = None  # with token_ids_logprob: one per asked id


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None = None  # [bs] float32, raw-logit logprob of the chosen token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per request: (token_id, logprob)
    # Per request: the logprobs of its token_ids_logprob ids (None for requests without).
    token_ids_logprobs: list[list[float] | None] | None = None
    input_logprobs: list[InputLogprobs] | None = None  # per request (EXTEND with input logprobs)

    # On a GPU: the pinned host buffer ``start_host_copy`` fills, and the event that says it is.
    _host: torch.Tensor | None = field(default=None, repr=False)
    _copied: Any = field(default=None, repr=False)

    def _packed(self) -> torch.Tensor:
        """The ids, with the chosen logprobs as a second row when they were asked for: float64
        holds every token id exactly and every float32 logprob as it is."""
        if self.logprobs is None:
            return self.next_token_ids
        return torch.stack(
            (self.next_token_ids.to(torch.float64), self.logprobs.to(torch.float64))
        )

    def start_host_copy(self) -> None:
        """On a GPU, queue the step's one device-to-host copy (the next tokens and the logprobs
        asked for) into pinned memory right behind the sampling, and record when it lands.

        ``to_host`` then waits for that event alone. A plain ``.tolist()`` waits for the whole
        stream instead: under the overlap schedule, where the next step is already queued behind
        this one when the scheduler reads these tokens, it would wait for that step too. No-op
        on CPU, where the tensors already are host memory."""
        if self.next_token_ids.device.type != "cuda":
            return
        packed = self._packed()
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._host, self._copied = host, copied

    def to_host(self) -> tuple[list[int], list[float] | None]:
        """The next token ids, and the chosen tokens' logprobs when they were asked for, as
        Python lists, from one device-to-host copy (``start_host_copy``'s, if it ran)."""
        if self._host is not None:
            self._copied.synchronize()
            packed = self._host
        else:
            packed = self._packed()
        if self.logprobs is None:
            return packed.tolist(), None
        ids, logprobs = packed.tolist()
        return [int(token) for token in ids], logprobs


class GreedyArgmax(CustomOp):
    """``logits.argmax(dim=-1)``: the first maximum of each row, NaN counting as the maximum.

    Native: a vectorised max over blocks of the vocabulary, then one argmax over the block maxima
    and one inside the winning block: several times faster on CPU for a large vocabulary, where a
    plain argmax does not vectorise. CPU: radixserve's kernel, which reads each row about once and
    a half, for the model's dtype and the float32 logits the sampler computes.
    """

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES
    cpu_ops = ("argmax",)

    def forward_native(self, logits: torch.Tensor) -> torch.Tensor:
        bs, vocab = logits.shape
        block = next((b for b in (128, 64, 32, 16) if vocab % b == 0), 0)
        if not block or bs == 0:
            return logits.argmax(dim=-1)
        blocks = logits.reshape(bs, vocab // block, block)
        best_block = blocks.amax(dim=-1).argmax(dim=-1)
        rows = torch.arange(bs, device=logits.device)
        return best_block * block + blocks[rows, best_block].argmax(dim=-1)

    def forward_cpu(self, logits: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.argmax(logits)

    def forward_cuda(self, logits: torch.Tensor) -> torch.Tensor:
        from radixserve.layers import triton_sampling

        return triton_sampling.argmax(logits)


class TemperatureSample(CustomOp):
    """One token per row from ``softmax(logits / temperature)``, tokens below ``min_p`` times the
    row's most likely one removed, drawn at the given uniforms: the sampler's path for batches
    that filter by neither top_k nor top_p (those sort, and keep the native path everywhere).

    Native: softmax, the min_p filter, and the float64 inverse-CDF search (``_invert_cdf``).
    CUDA: one Triton kernel (``layers/triton_sampling.py``) in place of about ten launches; it
    sums in float32, so a uniform within rounding of a boundary may take the neighbouring token.
    """

    def forward_native(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        min_ps: torch.Tensor | None,
        uniforms: torch.Tensor,
    ) -> torch.Tensor:
        probs = torch.softmax(logits / temperatures, dim=-1)
        if min_ps is not None:
            probs = _filter_min_p(probs, min_ps)
        return _invert_cdf(probs, uniforms)

    def forward_cuda(self, *args: torch.Tensor | None) -> torch.Tensor:
        """``forward_native``'s arguments, to the kernel."""
        from radixserve.layers import triton_sampling

        return triton_sampling.temperature_sample(*args)


class TokenBitmask(CustomOp):
    """Sets the logits a grammar forbids to ``-inf``, in place (``GrammarMask``'s rows only).

    Native: the grammar backend's own apply (xgrammar's, on any device). CPU: radixserve's kernel
    (``csrc/token_bitmask.cpp``), which turns each word of the bitmask into the lane mask of a
    store of ``-inf``; xgrammar's CPU apply tests the tokens one by one, most of a constrained
    decode step's own cost at batch 32 with a 150k vocabulary. Same result, bit for bit.
    """

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES
    cpu_ops = ("apply_token_bitmask",)

    def forward_native(self, mask: GrammarMask, logits: torch.Tensor) -> None:
        mask.apply_backend(logits)

    def forward_cpu(self, mask: GrammarMask, logits: torch.Tensor) -> None:
        cpu_kernels.apply_token_bitmask(logits, mask.bitmask, mask.rows)


class Sampler:
    """Stateless but for the argmax and grammar-mask ops it builds, for the device and model
    dtype of the build context it is created in (``layers/custom_op.py``): everything per step
    comes from ``SamplingBatchInfo``."""

    def __init__(self) -> None:
        self.greedy_argmax = GreedyArgmax()
        self.token_bitmask = TokenBitmask()
        self.temperature_sample = TemperatureSample()

    def __call__(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        token_ids_logprobs: list[list[int] | None] | None = None,
    ) -> SampleOutput:
        """Sample one token per row; ``top_logprobs_nums[i]`` top entries and the logprobs of
        ``token_ids_logprobs[i]`` for request ``i``."""
        assert logits.shape == (sampling_info.batch_size, sampling_info.vocab_size), logits.shape
        if sampling_info.is_all_greedy and not return_logprob:
            if not sampling_info.modifies_logits:
                return SampleOutput(self.greedy_argmax(logits))
            if sampling_info.only_grammar_mask:
                # Nobody reads the raw logits: mask them in place, in the model's dtype.
                self.token_bitmask(sampling_info.grammar_mask, logits)
                return SampleOutput(self.greedy_argmax(logits))
        logits = logits.float()
        # Without logprobs the raw logits are not read again: process them in place.
        processed = sampling_info.process_logits(
            logits, in_place=not return_logprob, apply_mask=self.token_bitmask
        )
        if sampling_info.is_all_greedy:
            next_token_ids = self.greedy_argmax(processed)
        else:
            greedy = self.greedy_argmax(processed)
            next_token_ids = torch.where(
                sampling_info.top_ks == 1, greedy, self._sample(processed, sampling_info)
            )

        if not return_logprob:
            return SampleOutput(next_token_ids)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(-1, next_token_ids.unsqueeze(-1)).squeeze(-1)
        top = None if top_logprobs_nums is None else _top_logprobs(logprobs, top_logprobs_nums)
        by_id = None
        if token_ids_logprobs is not None:
            by_id = _token_ids_logprobs(logprobs, token_ids_logprobs, [1] * len(token_ids_logprobs))
        return SampleOutput(next_token_ids, chosen, top, by_id)

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        uniforms = _uniforms(info, logits.device)
        if not info.need_top_p_top_k:
            min_ps = info.min_ps if info.need_min_p else None
            return self.temperature_sample(logits, info.temperatures, min_ps, uniforms)
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs = _filter_top_k_top_p(probs, info.top_ks, info.top_ps)
        if info.need_min_p:
            probs = _filter_min_p(probs, info.min_ps)
        return _invert_cdf(probs, uniforms)


def _uniforms(info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
    """``[bs, 1]`` float64 uniforms in [0, 1): global RNG, except for seeded rows."""
    uniforms = torch.rand(info.batch_size, 1, dtype=torch.float64, device=device)
    if info.seeded_rows:
        # One scalar per row, drawn on CPU: no kernel launch per row, same value on every device.
        generator = torch.Generator()
        values = []
        for row in info.seeded_rows:
            generator.manual_seed(_generator_seed(row))
            values.append(float(torch.rand((), dtype=torch.float64, generator=generator)))
        rows = torch.tensor([row.index for row in info.seeded_rows], device=device)
        uniforms[rows, 0] = torch.tensor(values, dtype=torch.float64, device=device)
    return uniforms


def _invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw token ``i`` with probability ``probs[i] / probs.sum()`` per row.

    The float64 running sum keeps tiny probabilities from vanishing in a large vocabulary. A
    zero-probability token is never drawn: its running sum equals its predecessor's.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    ids = torch.searchsorted(cdf, uniforms * total, right=True)
    # uniform * total may round up to total: the answer is then the last token that has mass.
    last = torch.searchsorted(cdf, total)
    # The clamp only matters for NaN rows (non-finite logits), to keep the id in range.
    return torch.minimum(ids, last).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _filter_top_k_top_p(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Zero tokens outside the top_k, then outside the top_p nucleus of what top_k kept.

    A token survives top_p if the mass strictly before it (in descending order) is below
    ``top_p`` of the kept mass, and the most likely token always survives (also a ``top_p``
    too small for float32, which rounds to 0 and would otherwise drop every token).
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks >= top_ks.unsqueeze(-1), 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    kept_mass = cumulative[:, -1:]
    top_ps = top_ps.unsqueeze(-1)
    # top_p == 1 must keep everything even when rounding pushes the running sum past 1.
    beyond_p = (cumulative - sorted_probs >= top_ps * kept_mass) & (top_ps < 1.0) & (ranks > 0)
    sorted_probs = sorted_probs.masked_fill(beyond_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _filter_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than ``min_p`` times the row's most likely token."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(-1)
    return probs.masked_fill(probs < threshold, 0.0)


def _generator_seed(row: SeededRow) -> int:
    """Mix (seed, step) into a 64-bit generator seed (splitmix64), so that nearby seeds and
    consecutive steps get unrelated noise."""
    return _splitmix64((_splitmix64(row.seed & _MASK64) + row.step) & _MASK64)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _top_logprobs(logprobs: torch.Tensor, nums: list[int]) -> list[list[tuple[int, float]]]:
    """Per request the ``nums[i]`` most likely tokens, most likely first (one device→host copy)."""
    assert len(nums) == logprobs.shape[0], "one top_logprobs_num per request"
    k = min(max(nums, default=0), logprobs.shape[-1])
    if k <= 0:
        return [[] for _ in nums]
    values, ids = logprobs.topk(k, dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return [list(zip(ids_l[i][:n], values_l[i][:n], strict=True)) for i, n in enumerate(nums)]


def _token_ids_logprobs(
    logprobs: torch.Tensor, ids: list[list[int] | None], rows_per_request: list[int]
) -> list[list[float] | None]:
    """Per row the logprobs of its request's ``ids`` (None for a request without), where
    request i owns the next ``rows_per_request[i]`` rows."""
    out: list[list[float] | None] = []
    row = 0
    for request_ids, count in zip(ids, rows_per_request, strict=True):
        if request_ids:
            index = torch.tensor(request_ids, dtype=torch.int64, device=logprobs.device)
            out.extend(logprobs[row : row + count, index].tolist())
        else:
            out.extend([None] * count)
        row += count
    return out


def input_logprobs(
    rows: torch.Tensor,
    targets: list[int],
    counts: list[int],
    top_logprobs_nums: list[int] | None,
    token_ids_logprobs: list[list[int] | None] | None,
) -> list[InputLogprobs]:
    """Logprobs of prompt tokens from their positions' logits ``rows`` (``[sum(counts), vocab]``,
    request i owning ``counts[i]`` of them in order; row k scores ``targets[k]``)."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    values = logprobs.gather(-1, index.unsqueeze(-1)).squeeze(-1).tolist()
    top = None
    if top_logprobs_nums is not None and any(top_logprobs_nums):
        per_row = [n for n, c in zip(top_logprobs_nums, counts, strict=True) for _ in range(c)]
        top = _top_logprobs(logprobs, per_row)
    by_id = None
    if token_ids_logprobs is not None:
        by_id = _token_ids_logprobs(logprobs, token_ids_logprobs, counts)
    out = []
    start = 0
    for i, count in enumerate(counts):
        end = start + count
        out.append(
            InputLogprobs(
                values[start:end],
                top[start:end] if top is not None and top_logprobs_nums[i] else None,
                by_id[start:end] if by_id is not None and token_ids_logprobs[i] else None,
            )
        )
        start = end
    return out
