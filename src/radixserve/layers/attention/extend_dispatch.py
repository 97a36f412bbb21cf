"""Which kernel attends a prefill (EXTEND) request on CPU, per (head_dim, GQA group, extend-length
bucket, prefix-length bucket), chosen by measurement on the machine that runs it
(``--cpu-kernel-autotune on``) or by a static table (``off``).

Why measure: radixserve's extend kernel (``csrc/extend_attention.cpp``, float32 FMAs) is batch
invariant and fastest for short extends, but for long ones torch's SDPA (its CPU flash kernel, on
AMX where the CPU has it) can be 1.5-2.5x faster on one CPU and slower on another: a 4,096-token
chunk measured 1.10x in one run and 0.86x in another (issue 38).

- Candidates: ``native`` (the extend kernel: one call for the batch; batch invariant) and
  ``sdpa`` (``F.scaled_dot_product_attention`` per request over its new K/V, or over its K/V
  gathered from the pool when it has a cached prefix; not batch invariant: its sums depend on the
  chunk and on whether the prefix came from the cache). Deterministic inference keeps ``native``.
- Cells: a request with ``e`` new tokens and ``p`` cached ones falls in the smallest extend
  bucket (``EXTEND_BUCKETS``) holding ``e`` and the smallest prefix bucket (``PREFIX_BUCKETS``)
  holding ``p`` (the last bucket of each holds anything larger); each request of a batch runs its
  cell's choice, so a batch can mix both.
- Measuring: each cell is timed at its bucket sizes, one request, the candidates taking turns,
  cheapest cells first, until ``budget_s``; cells past it keep the static choice and are measured
  at a later start. The seconds go to the linear kernels' cache (``layers/kernel_dispatch.py``:
  one file per CPU model, flags, torch version, threads and kernel sources) under one key per
  (dtype, head_dim, group, candidates), and ``kernel_dispatch.choose`` picks per cell (the static
  choice stays unless another is ``SWITCH_MARGIN`` faster, in two timings: a cell that would
  switch is timed again while the budget allows, each candidate keeping its better time).
- Load: as for the linears (``kernel_dispatch``), a table timed while other processes used the
  CPUs is used, marked busy in the cache, and timed again at a start that finds the machine
  quiet.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_kernels, kernel_dispatch
from radixserve.layers.cpu_contention import LoadProbe, MachineLoad

logger = logging.getLogger(__name__)

NATIVE, SDPA = "native", "sdpa"
CANDIDATES = {NATIVE: True, SDPA: False}  # name -> batch invariant
EXTEND_BUCKETS = (16, 64, 256, 1024, 4096)
PREFIX_BUCKETS = (0, 1024, 4096)
NUM_CELLS = len(EXTEND_BUCKETS) * len(PREFIX_BUCKETS)
DEFAULT_BUDGET_S = 5.0
# On a CPU with AMX, bf16: SDPA from these extend lengths (fresh prompt / cached prefix), from the
# runs in benchmarks/RESULTS.md (session 16); elsewhere the extend kernel everywhere.
STATIC_SDPA_FROM = (1024, 256)


def _bucket(value: int, buckets: Sequence[int]) -> int:
    for i, size in enumerate(buckets):
        if value <= size:
            return i
    return len(buckets) - 1


def cell_index(extend_len: int, prefix_len: int) -> int:
    """The cell of a request: prefix bucket major, extend bucket minor."""
    return _bucket(prefix_len, PREFIX_BUCKETS) * len(EXTEND_BUCKETS) + _bucket(
        extend_len, EXTEND_BUCKETS
    )


def cell_sizes(cell: int) -> tuple[int, int]:
    """``(extend_len, prefix_len)`` a cell is timed at."""
    p, e = divmod(cell, len(EXTEND_BUCKETS))
    return EXTEND_BUCKETS[e], PREFIX_BUCKETS[p]


def allowed_candidates(batch_invariant: bool) -> tuple[str, ...]:
    return tuple(n for n, invariant in CANDIDATES.items() if invariant or not batch_invariant)


def static_table(allowed: Sequence[str], amx_cpu: bool, dtype: torch.dtype) -> tuple[str, ...]:
    """The choice per cell without measuring: SDPA on AMX CPUs for bf16 long extends
    (``STATIC_SDPA_FROM``), where it was measured faster; the extend kernel elsewhere."""
    table = []
    for cell in range(NUM_CELLS):
        extend, prefix = cell_sizes(cell)
        sdpa = (
            SDPA in allowed
            and amx_cpu
            and dtype == torch.bfloat16
            and extend >= STATIC_SDPA_FROM[prefix > 0]
        )
        table.append(SDPA if sdpa else NATIVE)
    return tuple(table)


def _label(e: int) -> str:
    return f"{EXTEND_BUCKETS[e]}+" if e == len(EXTEND_BUCKETS) - 1 else str(EXTEND_BUCKETS[e])


def describe(table: Sequence[str]) -> str:
    """``table`` as one line per prefix bucket, e.g. ``prefix 0: 16-256 native, 1024+ sdpa``."""
    parts = []
    for p, prefix in enumerate(PREFIX_BUCKETS):
        row = table[p * len(EXTEND_BUCKETS) : (p + 1) * len(EXTEND_BUCKETS)]
        runs: list[list] = []
        for e, name in enumerate(row):
            if runs and runs[-1][2] == name:
                runs[-1][1] = e
            else:
                runs.append([e, e, name])
        text = ", ".join(
            f"{_label(a)} {n}" if a == z else f"{_label(a)}-{_label(z)} {n}" for a, z, n in runs
        )
        last = p == len(PREFIX_BUCKETS) - 1
        parts.append(f"prefix {prefix}{'+' if last else ''}: {text}")
    return "; ".join(parts)


@dataclass(frozen=True)
class PagedExtend:
    """One layer's EXTEND batch as the kernels see it: per-head views in the pool's dtype."""

    q: torch.Tensor  # [tokens, heads, head_dim]
    k: torch.Tensor  # [tokens, kv_heads, head_dim]
    v: torch.Tensor
    loc: torch.Tensor  # [tokens] pool slots of the new tokens
    k_buffer: torch.Tensor  # [slots, kv_heads, head_dim]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor  # [requests]
    seq_lens: torch.Tensor  # [requests]
    extend_lens: torch.Tensor  # [requests] int64
    scale: float


def attend_native(b: PagedExtend) -> torch.Tensor:
    """The extend kernel over the whole batch (it writes the new K/V itself)."""
    return cpu_kernels.paged_attention(
        b.q, b.k, b.v, b.loc, b.k_buffer, b.v_buffer, b.req_to_token, b.req_pool_indices,
        b.seq_lens, b.scale, b.extend_lens,
    )


def attend_sdpa_one(
    b: PagedExtend, start: int, extend: int, prefix: int, pool_row: int, out: torch.Tensor
) -> None:
    """SDPA for the request whose new tokens are rows ``start:start + extend`` of ``b`` (its K/V
    already in the pool when ``prefix`` > 0), into the same rows of ``out``."""
    heads, kv_heads = b.q.shape[1], b.k.shape[1]
    rows = slice(start, start + extend)
    q = b.q[rows].transpose(0, 1).unsqueeze(0)
    if prefix == 0:  # a fresh prompt: its own new K/V, SDPA's causal path
        keys, values, mask = b.k[rows], b.v[rows], None
    else:
        slots = b.req_to_token[pool_row, : prefix + extend]
        keys, values = b.k_buffer.index_select(0, slots), b.v_buffer.index_select(0, slots)
        # query j sits at position prefix + j and sees keys up to it (bottom-right causal)
        mask = torch.ones(extend, prefix + extend, dtype=torch.bool).tril_(prefix)
    o = F.scaled_dot_product_attention(
        q,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=b.scale,
        enable_gqa=heads != kv_heads,
    )
    out[rows] = o[0].transpose(0, 1)


def one_request(
    extend: int, prefix: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedExtend:
    """A batch of one request in a pool of its own (for timing a cell)."""
    seq = prefix + extend

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    k_buffer, v_buffer = rand(seq + 1, kv_heads, head_dim), rand(seq + 1, kv_heads, head_dim)
    return PagedExtend(
        rand(extend, heads, head_dim), rand(extend, kv_heads, head_dim),
        rand(extend, kv_heads, head_dim), torch.arange(prefix + 1, seq + 1), k_buffer, v_buffer,
        torch.arange(1, seq + 1).unsqueeze(0), torch.zeros(1, dtype=torch.int64),
        torch.tensor([seq]), torch.tensor([extend]), head_dim**-0.5,
    )


def _run_alone(name: str, b: PagedExtend) -> torch.Tensor:
    if name == NATIVE:
        return attend_native(b)
    out = torch.empty_like(b.q)
    prefix = int(b.seq_lens[0]) - b.q.shape[0]
    attend_sdpa_one(b, 0, b.q.shape[0], prefix, 0, out)
    return out


@dataclass(frozen=True)
class Shape:
    """What a dispatch table is for: the pool's dtype, head_dim and query heads per KV head."""

    dtype: torch.dtype
    head_dim: int
    group: int
    candidates: tuple[str, ...]

    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"attention:{dtype}:head_dim={self.head_dim}:group={self.group}:" + "+".join(
            self.candidates
        )


def measure(
    shape: Shape, cells: Sequence[int], budget_end: float, kv_heads: int = 1
) -> dict[str, list[float | None]]:
    """Seconds of one request per candidate in ``cells`` (cheapest first), the candidates taking
    turns; best of up to three calls (one when a call takes over 20 ms). None past
    ``budget_end``, and for the cells the last one's time predicts would end past it. One KV
    head: both candidates' time grows with the KV heads alike."""
    seconds: dict[str, list[float | None]] = {n: [None] * NUM_CELLS for n in shape.candidates}
    gen = torch.Generator().manual_seed(0)
    heads = shape.group * kv_heads

    def work(cell: int) -> int:  # query-key pairs: what both candidates' time grows with
        extend, prefix = cell_sizes(cell)
        return extend * (prefix + extend // 2 + 1)

    per_pair = 0.0  # seconds per pair of the last cell, warm-up and both candidates included
    for cell in sorted(cells, key=work):
        started = time.perf_counter()
        # a cell that would end past the budget is left for a later start
        if started + per_pair * work(cell) > budget_end:
            break
        extend, prefix = cell_sizes(cell)
        batch = one_request(extend, prefix, heads, kv_heads, shape.head_dim, shape.dtype, gen)
        best = dict.fromkeys(shape.candidates, float("inf"))
        for name in shape.candidates:
            _run_alone(name, batch)  # warm-up
        for _ in range(3):
            for name in shape.candidates:
                start = time.perf_counter()
                _run_alone(name, batch)
                best[name] = min(best[name], time.perf_counter() - start)
            if min(best.values()) > 0.02 or time.perf_counter() > budget_end:
                break
        for name in shape.candidates:
            seconds[name][cell] = best[name]
        per_pair = (time.perf_counter() - started) / work(cell)
    return seconds


def cached_or_static(
    shape: Shape, static: tuple[str, ...], cache: kernel_dispatch.DispatchCache
) -> tuple[tuple[str, ...], str]:
    """The table ``tune`` gives ``shape`` from ``cache`` without measuring, and whether any
    cell of it was ``measured`` or it is all ``static`` (for benchmarks that report it)."""
    seconds = cache.get(shape.key()) if len(shape.candidates) > 1 else None
    if not seconds or all(v is None for values in seconds.values() for v in values):
        return static, "static"
    return kernel_dispatch.choose(seconds, static), "measured"


MeasureFn = Callable[[Shape, Sequence[int], float], dict[str, list[float | None]]]


def tune(
    shape: Shape,
    static: tuple[str, ...],
    cache: kernel_dispatch.DispatchCache | None,
    budget_s: float = DEFAULT_BUDGET_S,
    measure_fn: MeasureFn | None = None,
    load: LoadProbe | None = None,
) -> tuple[str, ...]:
    """The table of ``shape``: cells in ``cache`` are not timed again (unless they were timed
    while the machine was busy and it is quiet now: ``kernel_dispatch``'s rule); the others are
    measured within ``budget_s`` (``measure_fn``, ``measure`` by default; ``load``,
    ``MachineLoad`` by default: tests inject both), merged into the cache, and chosen with
    ``kernel_dispatch.choose`` against ``static``."""
    if len(shape.candidates) < 2:
        return static
    measure_fn = measure_fn or measure
    load = load or MachineLoad()
    start = time.perf_counter()
    busy = False
    with cache.locked() if cache is not None else contextlib.nullcontext():
        cached = (cache.get(shape.key()) if cache is not None else None) or {}
        seconds = {n: list(cached.get(n, [None] * NUM_CELLS)) for n in shape.candidates}
        missing = [c for c in range(NUM_CELLS) if any(s[c] is None for s in seconds.values())]
        if cached and not missing and shape.key() in kernel_dispatch.stale_keys(
                [shape.key()], cache, load):
            missing = list(range(NUM_CELLS))  # timed under load, and the machine is quiet now
        if missing:
            load.wait_until_quiet(min(kernel_dispatch.SETTLE_S, budget_s))
            with load.window() as window:
                fresh = measure_fn(shape, missing, start + budget_s)
            # busy: timed under load, or busy cells the budget left unmeasured again
            busy = window.busy or (shape.key() in (cache.busy_keys() if cache else ()) and any(
                values[c] is None for values in fresh.values() for c in missing))
            for name, values in fresh.items():
                for cell in missing:
                    if values[cell] is not None:
                        seconds[name][cell] = values[cell]
            # a cell that would leave the static table is timed again (where the budget still
            # allows), each candidate keeping its better time: as kernel_dispatch.measure does
            switched = [c for c in kernel_dispatch.switched_buckets(seconds, static)
                        if c in missing]
            if switched:
                with load.window() as window_again:
                    again = measure_fn(shape, switched, start + budget_s)
                busy = busy or window_again.busy
                kernel_dispatch.keep_better(seconds, again, switched)
            if cache is not None:
                cache.put({shape.key(): seconds}, [shape.key()] if busy else [])
    table = kernel_dispatch.choose(seconds, static)
    unmeasured = sum(any(s[c] is None for s in seconds.values()) for c in range(NUM_CELLS))
    logger.info(
        "attention autotune %s: %d cells, %d timed now%s, %d from cache, %d static (past the "
        "%.1f s budget), in %.2f s", shape.key(), NUM_CELLS, len(missing) - unmeasured,
        " (the machine was busy: measured again at a quiet start)" if busy else "",
        NUM_CELLS - len(missing), unmeasured, budget_s, time.perf_counter() - start,
    )
    logger.info("attention dispatch %s: %s", shape.key(), describe(table))
    return table
