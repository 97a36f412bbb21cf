"""This machine's physical limits, so benchmark results can be read as a fraction of them.

- memory bandwidth (GB/s): a large tensor copy (read + write bytes) and a large sum (read bytes),
  on buffers far larger than the last-level cache; best of ``--repeats``;
- GEMM throughput (GFLOP/s): ``torch.matmul`` of square ``--gemm-size`` matrices in bf16 and fp32
  (2·n³ flops each), best of ``--repeats``.

Batch-1 decode is bandwidth bound: every weight byte is read once per token, so its ceiling is
``bandwidth / weight bytes`` tokens per second. Prefill is compute bound (the GEMM peak). Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth_gbs(num_bytes: int, repeats: int) -> dict[str, float]:
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), repeats)
    sum_s = best_seconds(lambda: src.sum(), repeats)
    return {
        "copy_gb_per_s": round(2 * num_bytes / copy_s / 1e9, 1),  # read + write
        "read_gb_per_s": round(num_bytes / sum_s / 1e9, 1),
    }


def gemm_gflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    seconds = best_seconds(lambda: torch.matmul(a, b), repeats)
    return round(2 * n**3 / seconds / 1e9, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buffer-mb", type=int, default=1024, help="bandwidth buffer size")
    p.add_argument("--gemm-size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, object] = {"threads": torch.get_num_threads()}
    result.update(bandwidth_gbs(args.buffer_mb << 20, args.repeats))
    result["bf16_gemm_gflops"] = gemm_gflops(args.gemm_size, torch.bfloat16, args.repeats)
    result["fp32_gemm_gflops"] = gemm_gflops(args.gemm_size, torch.float32, args.repeats)
    result["gemm_size"] = args.gemm_size
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
