"""Our linear kernel against torch's ``F.linear`` on one decoder layer's four projections.

``transformers`` runs torch's linear (oneDNN); at a batch where a model's time is its linears,
this ratio is the most our engine can gain over it, whatever the rest of the step costs. The
shape sweep's targets are read against it (``RESULTS.md``). Both sides get the same weights,
the same inputs and the same threads, in one process; each projection is timed on its own
(its weight warm in cache after the first call), best of ``--repeats`` batches of calls.

Prints one JSON line per projection, then one per model, dtype and batch size with the layer's
time on each side and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from bench_offline_throughput import resolve_model

from radixserve.layers import cpu_kernels
from radixserve.model_config import ModelConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


def best_seconds(calls: int, repeats: int, fn, *fn_args) -> float:
    """The fastest mean time of ``fn(*fn_args)`` over ``repeats`` batches of ``calls`` calls."""
    fn(*fn_args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*fn_args)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small,sweep-hd128-gqa8-h2048",
                   help="comma-separated: tiny, small, sweep-* shapes or checkpoint directories")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.load_cpu_kernels():
        raise SystemExit("radixserve's CPU kernels do not load on this machine")
    gen = torch.Generator().manual_seed(0)
    for name in args.models.split(","):
        label, path = resolve_model(name)
        shapes = layer_projections(ModelConfig.from_path(path))
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            weights = {proj: (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
                       for proj, (n, k) in shapes.items()}
            packed = {proj: cpu_kernels.pack_linear_weight(w) for proj, w in weights.items()}
            for m in (int(b) for b in args.batch_sizes.split(",")):
                ours_total = torch_total = 0.0
                for proj, (n, k) in shapes.items():
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    calls = max(3, int(2e8 / (2 * m * n * k)))
                    ours = best_seconds(calls, args.repeats, cpu_kernels.linear, x, packed[proj],
                                        None, n)
                    theirs = best_seconds(calls, args.repeats, F.linear, x, weights[proj])
                    ours_total, torch_total = ours_total + ours, torch_total + theirs
                    flop = 2 * m * n * k
                    print(json.dumps({
                        "model": label, "dtype": dtype_name, "batch_size": m, "projection": proj,
                        "n": n, "k": k, "radixserve_gflops": round(flop / ours / 1e9, 1),
                        "torch_gflops": round(flop / theirs / 1e9, 1),
                        "speedup": round(theirs / ours, 2)}), flush=True)
                print(json.dumps({
                    "comparison": "layer_linears", "model": label, "dtype": dtype_name,
                    "batch_size": m, "radixserve_ms": round(ours_total * 1e3, 3),
                    "torch_ms": round(torch_total * 1e3, 3),
                    "speedup": round(torch_total / ours_total, 2)}), flush=True)


if __name__ == "__main__":
    main()
