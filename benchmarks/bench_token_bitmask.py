"""A grammar's token bitmask applied to logits: xgrammar's CPU apply vs radixserve's kernel.

The part of a constrained decode step that grows with batch x vocabulary (issue #12). Each
implementation masks ``--batch`` rows of ``--vocab`` logits in bf16 and float32, with bitmasks
that forbid every token (what a JSON grammar does at most steps), half of them at random, or
none. Times are CPU time of this thread (``time.thread_time``, one torch thread), best of
``--repeats`` rounds of ``--calls`` calls, so time other processes take from the machine does not
count. Prints a JSON line per case; the argmax of the same logits is there for scale.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=151936, help="Qwen2's padded vocabulary")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def best_ms(fn: Callable[[], object], calls: int, repeats: int) -> float:
    fn()
    rounds = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        rounds.append((time.thread_time() - start) / calls * 1e3)
    return min(rounds)


def main() -> None:
    args = parse_args()
    import xgrammar as xgr

    from radixserve.layers import cpu_kernels

    if not cpu_kernels.has_ops("apply_token_bitmask"):  # not in an AVX2 build
        raise SystemExit("radixserve's token-bitmask kernel does not load on this machine")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    words = -(-args.vocab // 32)
    rows = list(range(args.batch))
    bitmasks = {
        "all_forbidden": torch.zeros(args.batch, words, dtype=torch.int32),
        "half_random": torch.randint(-(2**31), 2**31 - 1, (args.batch, words), generator=gen,
                                     dtype=torch.int32),
        "all_allowed": torch.full((args.batch, words), -1, dtype=torch.int32),
    }
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(args.batch, args.vocab, generator=gen).to(dtype)
        for name, bitmask in bitmasks.items():
            xgrammar_ms = best_ms(
                lambda x=logits, b=bitmask: xgr.apply_token_bitmask_inplace(x, b, indices=rows),
                args.calls, args.repeats)
            kernel_ms = best_ms(
                lambda x=logits, b=bitmask: cpu_kernels.apply_token_bitmask(x, b, rows),
                args.calls, args.repeats)
            argmax_ms = best_ms(lambda x=logits: cpu_kernels.argmax(x), args.calls, args.repeats)
            print(json.dumps({
                "dtype": str(dtype).removeprefix("torch."), "bitmask": name,
                "batch": args.batch, "vocab": args.vocab, "xgrammar_ms": round(xgrammar_ms, 3),
                "kernel_ms": round(kernel_ms, 3), "argmax_ms": round(argmax_ms, 3),
                "speedup": round(xgrammar_ms / kernel_ms, 2),
            }), flush=True)


if __name__ == "__main__":
    main()
