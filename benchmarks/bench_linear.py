"""Our linear kernel against torch's ``F.linear`` on one decoder layer's four projections.

``transformers`` runs torch's linear (oneDNN); at a batch where a model's time is its linears,
this ratio is the most our engine can gain over it, whatever the rest of the step costs. The
shape sweep's targets are read against it (``RESULTS.md``). Both sides get the same weights,
the same inputs and the same threads, in one process; each projection is timed on its own, best
of ``--repeats`` batches of calls. By default a projection's weight is warm in cache after the
first call; with ``--cold`` each call takes the next of enough copies of it to fill twice the
last-level cache, so every call streams its weight from memory, as in a model's step, where the
other layers' weights have evicted it.

The radixserve side is what the engine runs: each weight's kernel dispatch
(``layers/kernel_dispatch.py``, autotuned and cached as with ``--cpu-kernel-autotune on``, or
the static table with ``--static``). Every candidate kernel is timed as well, and a
projection's ``verdict`` is ``ok`` when the chosen kernel is within ``VERDICT_MARGIN`` of the
fastest candidate, ``WRONG`` when it is not; ``--check`` exits 1 on any ``WRONG``.

Prints one JSON line per projection, then one per model, dtype and batch size with the layer's
time on each side and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import torch_threads
from make_bench_models import resolve_model

from radixserve.layers import cpu_kernels, kernel_dispatch
from radixserve.layers.attention import extend_dispatch as xd
from radixserve.layers.packed_weight import CpuPackedWeight
from radixserve.layers.quantization.int4 import GROUP, CpuInt4Weight
from radixserve.layers.quantization.int8 import CpuInt8Weight
from radixserve.model_config import ModelConfig, resolve_device

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VERDICT_MARGIN = 0.25  # the chosen kernel may be this much slower than the best: timing noise


def layer_projections(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(output, input) sizes of a Llama-family layer's fused projections."""
    hidden, head_dim = config.hidden_size, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    return {
        "qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }


def best_seconds(calls: int, repeats: int, fn, x: torch.Tensor, weights: list[torch.Tensor],
                 *fn_args) -> float:
    """The fastest mean time of ``fn(x, weight, *fn_args)`` over ``repeats`` batches of
    ``calls`` calls, the calls taking ``weights`` in turn (after one pass over all of them)."""
    for weight in weights:
        fn(x, weight, *fn_args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(x, weights[i % len(weights)], *fn_args)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs); 32 MiB where it reports none."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=32 << 20)


def copies(weight: torch.Tensor, cold: bool, cache_bytes: int | None = None) -> list[torch.Tensor]:
    """``weight`` alone, or (``cold``) as many copies as fill twice ``cache_bytes`` (default:
    the last-level cache)."""
    if not cold:
        return [weight]
    cache_bytes = cache_bytes or last_level_cache_bytes()
    count = -(-2 * cache_bytes // (weight.numel() * weight.element_size()))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def dispatched(weights: dict[str, torch.Tensor], static: bool) -> dict[str, CpuPackedWeight]:
    """Each weight packed, with the engine's dispatch: the cached autotune, or the static
    table."""
    packed = {proj: CpuPackedWeight(w) for proj, w in weights.items()}
    if not static:
        cache = kernel_dispatch.machine_cache()
        kernel_dispatch.tune(packed.values(), cache)
    return packed


def sig(value: float) -> float:
    """``value`` to three significant digits (a loaded machine's small rates stay above 0)."""
    return float(f"{value:.3g}")


def call(x: torch.Tensor, kernel) -> torch.Tensor:
    return kernel(x, None)


def print_kernel_dispatch(args: argparse.Namespace, model_path: str,
                          engine_kwargs: dict[str, Any]) -> None:
    """One JSON line per linear layer type: the kernel its batches run per row bucket, as the
    Engine just chose it (read back from the dispatch cache its autotune wrote, with the
    scheduler's thread count; the static table where it measured nothing)."""
    if resolve_device(args.device).type != "cpu" or not cpu_kernels.has_ops("linear"):
        return  # a GPU's kernels are chosen once at build time, no dispatch table to show
    config = ModelConfig.from_path(model_path, dtype=args.dtype)
    dtype = config.torch_dtype
    shapes = {**layer_projections(config), "lm_head": (config.vocab_size, config.hidden_size)}
    quantization = engine_kwargs.get("quantization")
    deterministic = engine_kwargs.get("enable_deterministic_inference", False)
    with torch_threads(args.threads or len(os.sched_getaffinity(0))):
        cache = kernel_dispatch.machine_cache()
        for layer, (n, k) in shapes.items():
            if quantization == "int8" or (quantization == "int4" and layer == "lm_head"):
                weight = CpuInt8Weight(torch.zeros(n, k, dtype=torch.int8), torch.ones(n, 1))
            elif quantization == "int4":
                groups = -(-k // GROUP)
                weight = CpuInt4Weight(torch.zeros(n, k, dtype=torch.uint8),
                                       torch.ones(n, groups, dtype=torch.float16),
                                       torch.zeros(n, groups, dtype=torch.float16))
            else:
                weight = CpuPackedWeight(torch.zeros(n, k, dtype=dtype))
            weight.activation_dtype = dtype
            weight.restrict(deterministic)
            table, source = kernel_dispatch.cached_or_static(weight, cache)
            print(json.dumps({"kernel_dispatch": layer, "n": n, "k": k, "kind": weight.kind(),
                              "source": source, "kernels": kernel_dispatch.describe(table),
                              "deterministic": deterministic}), flush=True)
        if cpu_kernels.attention_kernels_support(dtype, config.head_dim) is not None:
            return  # attention on the torch_native backend (an AVX2 CPU): no table
        # prefill attention per (extend, prefix) length bucket (layers/attention/extend_dispatch)
        allowed = xd.allowed_candidates(deterministic)
        shape = xd.Shape(dtype, config.head_dim,
                         config.num_attention_heads // config.num_key_value_heads, allowed)
        static = xd.static_table(allowed, cpu_kernels.amx_available(), dtype)
        table, source = xd.cached_or_static(shape, static, cache)
        print(json.dumps({"kernel_dispatch": "attention_extend", "kind": shape.key(),
                          "source": source, "kernels": xd.describe(table),
                          "deterministic": deterministic}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small,sweep-hd128-gqa8-h2048",
                   help="comma-separated: tiny, small, sweep-* shapes or checkpoint directories")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--cold", action="store_true",
                   help="stream every call's weight from memory (see the module docstring)")
    p.add_argument("--cold-cache-mib", type=int,
                   help="with --cold: the cache size to overflow (default: the CPU's last level)")
    p.add_argument("--static", action="store_true",
                   help="the static dispatch table (--cpu-kernel-autotune off)")
    p.add_argument("--calls", type=int,
                   help="calls per timing (default: enough for 0.2 GFLOP, at least 3)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a projection's verdict is WRONG")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.has_ops("linear"):
        raise SystemExit("radixserve's linear kernel does not load on this machine")
    gen = torch.Generator().manual_seed(0)
    wrong = []
    for name in args.models.split(","):
        label, path = resolve_model(name)
        shapes = layer_projections(ModelConfig.from_path(path))
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            weights = {proj: (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
                       for proj, (n, k) in shapes.items()}
            packed = dispatched(weights, args.static)
            # every candidate's kernel on each copy of the weight (one copy unless --cold)
            cache_bytes = args.cold_cache_mib << 20 if args.cold_cache_mib else None
            plain = {proj: copies(w, args.cold, cache_bytes) for proj, w in weights.items()}
            kernels = {}
            for proj, pw in packed.items():
                packs = [pw, *(CpuPackedWeight(w) for w in plain[proj][1:])]
                per_copy = [p.kernels() for p in packs]
                kernels[proj] = {cand: [k[cand] for k in per_copy] for cand in pw.candidates}
            for m in (int(b) for b in args.batch_sizes.split(",")):
                bucket = kernel_dispatch.bucket_index(m)
                ours_total = torch_total = 0.0
                for proj, (n, k) in shapes.items():
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    calls = args.calls or max(3, int(2e8 / (2 * m * n * k)))
                    seconds = {
                        cand: best_seconds(calls, args.repeats, call, x, kernels[proj][cand])
                        for cand in packed[proj].candidates
                    }
                    chosen = packed[proj].table[bucket]
                    ours = seconds[chosen]
                    theirs = best_seconds(calls, args.repeats, F.linear, x, plain[proj])
                    ours_total, torch_total = ours_total + ours, torch_total + theirs
                    best = min(seconds, key=seconds.__getitem__)
                    verdict = (
                        "ok" if ours <= seconds[best] * (1 + VERDICT_MARGIN) else "WRONG"
                    )
                    if verdict == "WRONG":
                        wrong.append((label, dtype_name, m, proj, chosen, best))
                    flop = 2 * m * n * k
                    print(json.dumps({
                        "model": label, "dtype": dtype_name, "batch_size": m, "projection": proj,
                        "n": n, "k": k, "cold": args.cold,
                        "radixserve_gflops": sig(flop / ours / 1e9),
                        "torch_gflops": sig(flop / theirs / 1e9),
                        "speedup": round(theirs / ours, 2),
                        "chosen": chosen, "best": best, "verdict": verdict,
                        "candidates_gflops": {c: sig(flop / t / 1e9)
                                              for c, t in seconds.items()}}), flush=True)
                print(json.dumps({
                    "comparison": "layer_linears", "model": label, "dtype": dtype_name,
                    "batch_size": m, "cold": args.cold, "radixserve_ms": round(ours_total * 1e3, 3),
                    "torch_ms": round(torch_total * 1e3, 3),
                    "speedup": round(torch_total / ours_total, 2)}), flush=True)
    for label, dtype_name, m, proj, chosen, best in wrong:
        print(f"WRONG DISPATCH: {label} {dtype_name} {proj} at {m} rows runs {chosen}, "
              f"{best} is more than {VERDICT_MARGIN:.0%} faster", file=sys.stderr)
    if wrong and args.check:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
