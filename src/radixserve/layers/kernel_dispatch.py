"""Which kernel multiplies a linear weight, per weight shape and batch-row bucket, chosen by
measurement on the machine that runs it (``--cpu-kernel-autotune on``) or by a static table
(``off``).

Why measure: the fastest kernel depends on the CPU and the shape. At one row radixserve's
blocked kernel streams the weight 2-4x faster than oneDNN's (``F.linear``); on a CPU with AMX,
oneDNN's AMX GEMM is up to 9x faster than the blocked kernel from 64 rows up, while on an
AVX-512 CPU without usable AMX the blocked kernel was the faster one there too. A table written
on one CPU is wrong on the other.

- Candidates (``CANDIDATES``): ``blocked`` (``csrc/linear.cpp``), ``amx``
  (``csrc/linear_amx.cpp``, bf16: a small-batch kernel up to 32 rows, a cache-blocked tile GEMM
  above), ``onednn`` (torch's ``F.linear`` on the plain weight); for int8
  weights ``int8_vnni`` (``csrc/linear_int8.cpp``) and ``int8_dequant_onednn`` (the weight
  dequantised to the activations' dtype, then ``F.linear``), for 4-bit weights ``int4_vnni``
  (``csrc/linear_int4.cpp``) and ``int4_dequant_onednn`` likewise. A ``PackedWeight`` lists those
  that take its shape and dtype; deterministic inference keeps only batch-invariant ones.
- Row buckets (``ROW_BUCKETS``): a batch of ``m`` rows runs the choice of the smallest bucket
  holding ``m``; 512 stands for 512 rows and more.
- ``choose``: per bucket, the fastest candidate, but the static table's choice is kept unless
  another is ``SWITCH_MARGIN`` faster, so timing noise does not flip a close call.
- The cache (``DispatchCache``): one JSON file per machine key (CPU model, CPU flags, torch
  version, torch threads, the kernels' source hash, oneDNN's settings, ``MEASURE_METHOD``) under
  ``~/.cache/radixserve/autotune/``, one entry per weight kind, shape and candidate set holding
  the measured seconds. A new CPU, torch or kernel build is a new key: it measures again.
- Start-up cost: ``tune`` measures each distinct shape once (the layers share a few), on a
  slice of at most ``TIMING_MAX_OUT`` output rows (the LM head's vocabulary rows all cost the
  same), interleaving the candidates, and stops measuring after ``budget_s`` (the rest keep the
  static table); the log says how long it took and what it chose. A bucket that would leave
  the static table is timed twice (``measure``): a switch needs both timings to agree.
- Load (``cpu_contention``): before measuring, ``tune`` waits up to ``SETTLE_S`` for the machine
  to be quiet (a server's other processes import torch while its scheduler starts). A shape
  timed while other processes used the CPUs anyway is used, and cached as *busy*: a later
  start that finds the machine quiet measures it again, so a table measured under load does not
  outlive the load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from radixserve import envs
from radixserve.cache_files import exclusive
from radixserve.layers.cpu_contention import LoadProbe, MachineLoad
from radixserve.layers.cpu_kernels import cpu_flags, kernel_sources_digest

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_BUCKET_ROWS = ROW_BUCKETS[-1]
SWITCH_MARGIN = 0.05  # a candidate replaces the static choice only when this much faster
TIMING_MAX_OUT = 4096  # output rows of the slice a large weight is timed on
DEFAULT_BUDGET_S = 5.0
SETTLE_S = 2.0  # the longest ``tune`` waits for a quiet machine before measuring
AUTOTUNE_MODES = ("on", "off")
# How ``measure`` times: a new way of timing measures again (timings taken the old way are not
# reused). 2: a bucket that leaves the static table is timed twice.
MEASURE_METHOD = "2"
STATIC_AMX_ROWS = 32  # the static table's AMX buckets (the small-batch kernel's rows)

BLOCKED, AMX, ONEDNN = "blocked", "amx", "onednn"
INT8_VNNI, INT8_DEQUANT = "int8_vnni", "int8_dequant_onednn"
INT4_VNNI, INT4_DEQUANT = "int4_vnni", "int4_dequant_onednn"


@dataclass(frozen=True)
class Candidate:
    name: str
    batch_invariant: bool  # a row's result is the same bits whatever else is in its batch


CANDIDATES = {
    c.name: c
    for c in (
        Candidate(BLOCKED, batch_invariant=True),
        Candidate(AMX, batch_invariant=False),  # the tiles sum in their own order
        Candidate(ONEDNN, batch_invariant=False),  # oneDNN picks its kernel by shape
        Candidate(INT8_VNNI, batch_invariant=True),
        Candidate(INT8_DEQUANT, batch_invariant=False),
        Candidate(INT4_VNNI, batch_invariant=True),
        Candidate(INT4_DEQUANT, batch_invariant=False),
    )
}


def bucket_index(rows: int) -> int:
    """The bucket of a batch of ``rows`` rows: the smallest holding it, the last for more."""
    for i, size in enumerate(ROW_BUCKETS):
        if rows <= size:
            return i
    return len(ROW_BUCKETS) - 1


BUCKET_OF_ROWS = tuple(bucket_index(rows) for rows in range(MAX_BUCKET_ROWS + 1))


def allowed_candidates(names: Iterable[str], batch_invariant: bool) -> tuple[str, ...]:
    """``names`` less those deterministic inference (``batch_invariant``) rules out."""
    return tuple(n for n in names if not batch_invariant or CANDIDATES[n].batch_invariant)


def static_table(allowed: Sequence[str], amx_cpu: bool, bf16: bool) -> tuple[str, ...]:
    """The choice per bucket without measuring, from the runs in ``benchmarks/RESULTS.md``: int8
    and 4-bit weights take their VNNI kernels; on a CPU with AMX, bf16 batches up to
    ``STATIC_AMX_ROWS`` rows take the AMX kernel (where the shape allows it) and larger ones
    oneDNN's AMX GEMM (radixserve's AMX GEMM above 32 rows won on some shapes and lost on others
    in one run, so only a measurement picks it);
    everything else the blocked kernel (the faster one on AVX-512 CPUs without AMX, and for
    float32)."""
    table = []
    for b in range(len(ROW_BUCKETS)):
        if INT8_VNNI in allowed:
            table.append(INT8_VNNI)
        elif INT4_VNNI in allowed:
            table.append(INT4_VNNI)
        elif AMX in allowed and ROW_BUCKETS[b] <= STATIC_AMX_ROWS:
            table.append(AMX)
        elif amx_cpu and bf16 and ONEDNN in allowed and ROW_BUCKETS[b] > STATIC_AMX_ROWS:
            table.append(ONEDNN)
        elif BLOCKED in allowed:
            table.append(BLOCKED)
        else:
            table.append(allowed[0])
    return tuple(table)


def choose(
    seconds: Mapping[str, Sequence[float | None]], static: Sequence[str]
) -> tuple[str, ...]:
    """Per bucket, the candidate of least ``seconds`` (None: not measured there); the
    ``static`` choice stays unless the fastest beats it by ``SWITCH_MARGIN``."""
    table = []
    for b, default in enumerate(static):
        timed = {n: s[b] for n, s in seconds.items() if s[b] is not None}
        if not timed:
            table.append(default)
            continue
        best = min(timed, key=lambda n: (timed[n], n != default))
        kept = timed.get(default)
        table.append(
            default if kept is not None and kept <= timed[best] * (1 + SWITCH_MARGIN) else best
        )
    return tuple(table)


def describe(table: Sequence[str]) -> str:
    """``table`` in runs of buckets, e.g. ``1-32 amx, 64-512+ onednn``."""
    runs: list[tuple[int, int, str]] = []
    for b, name in enumerate(table):
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], b, name)
        else:
            runs.append((b, b, name))

    def label(b: int) -> str:
        return f"{ROW_BUCKETS[b]}+" if b == len(ROW_BUCKETS) - 1 else str(ROW_BUCKETS[b])

    return ", ".join(
        f"{label(a)} {n}" if a == z else f"{label(a)}-{label(z)} {n}" for a, z, n in runs
    )


class Dispatched(Protocol):
    """What ``tune`` needs of a ``PackedWeight`` with several kernels."""

    weight: torch.Tensor
    candidates: tuple[str, ...]  # the kernels that take this weight
    table: tuple[str, ...]
    activation_dtype: torch.dtype

    def kind(self) -> str: ...
    def static(self) -> tuple[str, ...]: ...
    def kernels(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]: ...
    def timing_proxy(self, max_out: int) -> Dispatched: ...
    def set_table(self, table: Sequence[str]) -> None: ...


def shape_key(weight: Dispatched) -> str:
    n, k = weight.weight.shape
    return f"{weight.kind()}:{n}x{k}:{'+'.join(weight.candidates)}"


def tables_by_shape(weights: Iterable[Dispatched]) -> dict[str, tuple[str, ...]]:
    """The table of each distinct shape among ``weights`` that has a choice to make."""
    return {shape_key(w): w.table for w in weights if len(w.candidates) > 1}


def cached_or_static(weight: Dispatched, cache: DispatchCache) -> tuple[tuple[str, ...], str]:
    """The table ``tune`` gives ``weight`` from ``cache`` without measuring, and whether it
    was ``measured`` or is the ``static`` one (for benchmarks that report the dispatch)."""
    seconds = cache.get(shape_key(weight)) if len(weight.candidates) > 1 else None
    if seconds is None:
        return weight.static(), "static"
    return choose(seconds, weight.static()), "measured"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        return "unknown"
    return line.partition(":")[2].strip() or "unknown"


# oneDNN's settings that change which GEMM ``F.linear`` runs: a cap on the instructions it may
# use (``AVX512_CORE`` keeps it off AMX and AVX512-BF16) and its fp32 math mode (``BF16`` runs
# float32 GEMMs in bf16). Under another value the ``onednn`` timings are another kernel's.
ONEDNN_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE")


def machine_identity(cpu_flags: Iterable[str]) -> dict[str, str]:
    """What a measurement holds for: any change is a different cache file."""
    return {
        "cpu_model": _cpu_model(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(cpu_flags)).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "kernels": kernel_sources_digest(),
        "onednn": " ".join(f"{name}={os.environ[name]}" for name in ONEDNN_ENV
                           if os.environ.get(name)),
        "method": MEASURE_METHOD,
    }


def default_cache_root() -> Path:
    return envs.radixserve_cache_dir("autotune")


@dataclass
class DispatchCache:
    """Measured seconds per shape key, in one JSON file per machine identity; the keys
    measured while the machine was busy are listed apart (``busy``)."""

    root: Path
    identity: Mapping[str, str]
    _entries: dict[str, dict[str, list[float | None]]] | None = field(default=None, repr=False)
    _busy: set[str] = field(default_factory=set, repr=False)

    @property
    def path(self) -> Path:
        key = hashlib.sha256(json.dumps(dict(self.identity), sort_keys=True).encode())
        return self.root / f"{key.hexdigest()[:16]}.json"

    def _read(self) -> tuple[dict[str, dict[str, list[float | None]]], set[str]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}, set()
        if data.get("machine") != dict(self.identity):  # another machine's file: ignore it
            return {}, set()
        return data.get("entries", {}), set(data.get("busy", []))

    def _load(self) -> None:
        self._entries, self._busy = self._read()

    def get(self, key: str) -> dict[str, list[float | None]] | None:
        if self._entries is None:
            self._load()
        assert self._entries is not None
        return self._entries.get(key)

    def busy_keys(self) -> frozenset[str]:
        """The keys whose entries were measured while other processes used the CPUs."""
        if self._entries is None:
            self._load()
        return frozenset(self._busy)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while measuring and writing: ranks on one machine measure one at a time (not
        against each other) and merge their entries into one file."""
        self.root.mkdir(parents=True, exist_ok=True)
        with exclusive(self.path.with_suffix(".lock")):
            self._load()  # what others wrote while we waited
            yield

    def put(self, entries: Mapping[str, dict[str, list[float | None]]],
            busy: Iterable[str] = ()) -> None:
        """Merge ``entries`` in; those of ``busy`` are marked as measured under load, the
        others (re)measured on a quiet machine lose the mark."""
        stored, stored_busy = self._read()
        self._entries = {**stored, **entries}
        self._busy = (stored_busy - set(entries)) | set(busy)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"machine": dict(self.identity), "entries": self._entries,
                                   "busy": sorted(self._busy)}))
        os.replace(tmp, self.path)


def machine_cache() -> DispatchCache:
    """The cache of this machine (its CPU's flags, torch, threads, ...) under the default root."""
    return DispatchCache(default_cache_root(), machine_identity(cpu_flags()))


def stale_keys(keys: Iterable[str], cache: DispatchCache | None,
               load: LoadProbe) -> set[str]:
    """The ``keys`` to measure now: those ``cache`` lacks, and its busy ones when the
    machine is quiet now (one short look, only when there is a busy one)."""
    if cache is None:
        return set(keys)
    keys = list(keys)
    missing = {k for k in keys if cache.get(k) is None}
    busy = {k for k in keys if k not in missing} & cache.busy_keys()
    return missing | busy if busy and load.quiet() else missing


KernelFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def time_candidates(kernels: Mapping[str, KernelFn], x: torch.Tensor) -> dict[str, float]:
    """Seconds per call of each of ``kernels`` on ``x``, the candidates taking turns call by
    call after a warm-up call each: best of at least three calls and 2 ms per candidate."""
    names = list(kernels)
    best = dict.fromkeys(names, float("inf"))
    spent = dict.fromkeys(names, 0.0)
    for name in names:
        kernels[name](x, None)  # warm-up: first-call allocations, oneDNN's primitive cache
    calls = 0
    while calls < 3 or min(spent.values()) < 2e-3:
        for name in names:
            start = time.perf_counter()
            kernels[name](x, None)
            took = time.perf_counter() - start
            best[name], spent[name] = min(best[name], took), spent[name] + took
        calls += 1
        if calls >= 50:
            break
    return best


def switched_buckets(seconds: Mapping[str, Sequence[float | None]],
                     static: Sequence[str]) -> list[int]:
    """The buckets where ``choose`` would replace the ``static`` choice."""
    return [b for b, (got, default) in enumerate(zip(choose(seconds, static), static,
                                                     strict=True)) if got != default]


def keep_better(seconds: Mapping[str, list[float | None]],
                again: Mapping[str, Sequence[float | None]], indices: Iterable[int]) -> None:
    """Each candidate's better time of ``seconds`` and a second timing ``again`` at
    ``indices`` (buckets, or attention cells), in ``seconds``; an index ``again`` did not time
    keeps its first time."""
    indices = list(indices)
    for name, values in again.items():
        for i in indices:
            first, took = seconds[name][i], values[i]
            if took is not None:
                seconds[name][i] = took if first is None else min(first, took)


def measure(
    weight: Dispatched,
    budget_end: float = float("inf"),
    time_fn: Callable[[Mapping[str, KernelFn], torch.Tensor], dict[str, float]] = time_candidates,
) -> dict[str, list[float | None]]:
    """Seconds per call of each candidate at each bucket's rows (None past ``budget_end``),
    timed by ``time_fn`` (``time_candidates``; tests inject one).

    A bucket whose fastest candidate would replace the static table's choice is timed once more
    after the sweep, and each candidate keeps its better time of the two: the static choice
    loses a bucket (for good: the cache keeps it) only if it loses both times. One slow moment
    of the machine decided one otherwise: on the 2-vCPU Zen 3 guest the blocked kernel read
    0.66 ms at one row of the ``small`` benchmark model's ``down_proj`` (896 x 4864, bf16),
    against 0.24-0.50 ms in every other run; oneDNN (0.60 ms) took the bucket, and every bf16
    decode step at batch 1 paid about 6 ms more (benchmarks/RESULTS.md, session 33).

    ``budget_end`` stops the sweep, not the second timings of a completed one (at most one
    more timing per bucket): a sweep cut short is not cached, a completed one is confirmed."""
    proxy = weight.timing_proxy(TIMING_MAX_OUT)
    all_kernels = proxy.kernels()
    kernels = {name: all_kernels[name] for name in weight.candidates}
    k = weight.weight.shape[1]
    dtype = weight.activation_dtype
    seconds: dict[str, list[float | None]] = {n: [None] * len(ROW_BUCKETS) for n in kernels}
    gen = torch.Generator().manual_seed(0)

    def timed(b: int) -> dict[str, float]:
        return time_fn(kernels, torch.randn(ROW_BUCKETS[b], k, generator=gen).to(dtype))

    for b in range(len(ROW_BUCKETS)):
        if time.perf_counter() > budget_end:
            return seconds
        for name, took in timed(b).items():
            seconds[name][b] = took
    switched = switched_buckets(seconds, weight.static())
    again: dict[str, list[float | None]] = {n: [None] * len(ROW_BUCKETS) for n in kernels}
    for b in switched:
        for name, took in timed(b).items():
            again[name][b] = took
    keep_better(seconds, again, switched)
    return seconds


def tune(
    weights: Iterable[Dispatched],
    cache: DispatchCache | None,
    budget_s: float = DEFAULT_BUDGET_S,
    measure_fn: Callable[[Dispatched, float], dict[str, list[float | None]]] | None = None,
    load: LoadProbe | None = None,
) -> dict[str, tuple[str, ...]]:
    """Measure (or read from ``cache``) each distinct shape of ``weights`` once and give every
    weight its table; returns the tables by shape key and logs the cost and the choices.
    ``measure_fn``: the measurement, ``measure`` by default; ``load``: the machine's load,
    ``MachineLoad`` by default (tests inject both)."""
    measure_fn = measure_fn or measure
    load = load or MachineLoad()
    by_key: dict[str, list[Dispatched]] = {}
    for w in weights:
        if len(w.candidates) > 1:
            by_key.setdefault(shape_key(w), []).append(w)
    if not by_key:
        return {}
    start = time.perf_counter()
    measured: dict[str, dict[str, list[float | None]]] = {}
    busy: set[str] = set()
    from_cache = partial = 0
    context = cache.locked() if cache is not None else contextlib.nullcontext()
    with context:
        stale = stale_keys(by_key, cache, load)
        if stale:  # the wait counts against the budget
            load.wait_until_quiet(min(SETTLE_S, budget_s))
        tables = {}
        for key, group in by_key.items():
            static = group[0].static()
            previous = cache.get(key) if cache is not None else None
            if key in stale:
                if time.perf_counter() - start > budget_s:
                    tables[key] = choose(previous, static) if previous else static
                    partial += 1
                    continue
                with load.window() as window:
                    seconds = measure_fn(group[0], start + budget_s)
                if any(s[-1] is not None for s in seconds.values()):
                    measured[key] = seconds  # only complete measurements are kept
                    if window.busy:
                        busy.add(key)
                else:
                    partial += 1
                    seconds = previous or seconds
            else:
                assert previous is not None
                seconds = previous
                from_cache += 1
            tables[key] = choose(seconds, static)
        if cache is not None and measured:
            cache.put(measured, busy)
    for key, group in by_key.items():
        for w in group:
            w.set_table(tables[key])
    elapsed = time.perf_counter() - start
    logger.info(
        "kernel autotune: %d linear shapes, %d measured (%d while the machine was busy: "
        "measured again at a quiet start), %d from cache, %d cut by the %.1f s budget (static "
        "table where unmeasured), in %.2f s", len(by_key), len(measured), len(busy), from_cache,
        partial, budget_s, elapsed,
    )
    for key, table in tables.items():
        logger.info("kernel dispatch %s: %s", key, describe(table))
    return tables
