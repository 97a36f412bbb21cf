"""Hierarchical cache benchmark: shared documents whose working set is 4x the device KV pool.

``--docs`` (D) documents of ``--doc-len`` (L) random token ids; the device pool holds
``D * L / --working-set-ratio`` tokens (``--max-total-tokens``), so the radix cache alone cannot
keep them. Every request is one document plus ``--question-len`` (Q) new ids, and generates
``--output-len`` (O) tokens (greedy, ``ignore_eos``). The same workload runs on two servers
started by this script, one after the other: ``hicache`` (``--enable-hierarchical-cache``, host
tier large enough for every document) and ``radix`` (the plain radix cache). Per server:

- ``ttft``: ``--rounds`` rounds over the documents in order, one request at a time (each
  document was evicted from the device by the ones after it): the first round computes every
  document (``cold``), the later rounds re-ask them (``reask``): median TTFT of each;
- ``throughput``: ``--requests`` requests over shuffled documents, ``--concurrency`` at a time:
  requests/s and prompt tokens/s over the span.

One JSON line per server, then a summary: ``reask_ttft_ratio`` (hicache re-ask TTFT over radix
re-ask TTFT, which recomputes; target <= 0.3) and ``throughput_ratio`` (hicache over radix;
target >= 1.5), with the outputs of both servers checked equal.

    python benchmarks/bench_hicache.py --model tiny   # the run of RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx
from bench_common import BENCH_MODELS, Server, resolve_model
from bench_sessions import streamed_generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help=f"{' or '.join(BENCH_MODELS)} (built on first use) or a checkpoint dir")
    p.add_argument("--docs", "-D", type=int, default=8)
    p.add_argument("--doc-len", "-L", type=int, default=1024)
    p.add_argument("--question-len", "-Q", type=int, default=16)
    p.add_argument("--output-len", "-O", type=int, default=8)
    p.add_argument("--working-set-ratio", type=float, default=4.0,
                   help="documents' tokens over the device pool's")
    p.add_argument("--rounds", type=int, default=2, help="ttft phase: rounds over the docs")
    p.add_argument("--requests", type=int, default=24, help="throughput phase: requests")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--write-policy", default="write_through")
    p.add_argument("--dtype", default="float32", help="float32: both servers' outputs equal")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=500)
    return p.parse_args(argv)


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """``(documents, prompts)``: prompts are the ttft phase's then the throughput phase's."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(n)]

    docs = [ids(args.doc_len) for _ in range(args.docs)]
    prompts = [docs[d] + ids(args.question_len)
               for _ in range(args.rounds) for d in range(args.docs)]
    prompts += [docs[rng.randrange(args.docs)] + ids(args.question_len)
                for _ in range(args.requests)]
    return docs, prompts


async def run_server(base_url: str, args: argparse.Namespace,
                     prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    params = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}
    n_ttft = args.rounds * args.docs
    outputs: list[list[int]] = []
    cold, reask, cached, tiers = [], [], [], {"device": 0, "host": 0, "storage": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await streamed_generate(http, {"input_ids": [1, 2, 3], "sampling_params": params})
        for i, prompt in enumerate(prompts[:n_ttft]):
            ttft, out = await streamed_generate(http, {"input_ids": prompt,
                                                       "sampling_params": params})
            (cold if i < args.docs else reask).append(ttft)
            outputs.append(out["output_ids"])
            if i >= args.docs:
                cached.append(out["meta_info"]["cached_tokens"])
                for tier, n in (out["meta_info"].get("cached_tokens_details") or {}).items():
                    tiers[tier] += n
        sem = asyncio.Semaphore(args.concurrency)

        async def one(prompt: list[int]) -> list[int]:
            async with sem:
                _, out = await streamed_generate(http, {"input_ids": prompt,
                                                        "sampling_params": params})
                return out["output_ids"]

        start = time.perf_counter()
        outputs += await asyncio.gather(*(one(p) for p in prompts[n_ttft:]))
        span = time.perf_counter() - start
    throughput = prompts[n_ttft:]
    return {
        "cold_ttft_s": round(statistics.median(cold), 4),
        "reask_ttft_s": round(statistics.median(reask), 4) if reask else None,
        "reask_cached_tokens_mean": round(statistics.mean(cached), 1) if cached else None,
        "reask_cached_tokens_by_tier": tiers,
        "throughput_req_s": round(len(throughput) / span, 3),
        "throughput_prompt_tok_s": round(sum(map(len, throughput)) / span, 1),
    }, outputs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_path = resolve_model(args.model)
    _, prompts = make_workload(args)
    device_tokens = int(args.docs * args.doc_len / args.working_set_ratio)
    device_tokens = device_tokens // args.page_size * args.page_size
    base = ["--dtype", args.dtype, "--device", args.device, "--page-size", str(args.page_size),
            "--max-total-tokens", str(device_tokens), "--max-running-requests",
            str(args.concurrency)]
    # a host tier that holds every document, with room for the outputs
    ratio = 1.5 * args.working_set_ratio
    servers = {
        "hicache": [*base, "--enable-hierarchical-cache", "--hicache-ratio", str(ratio),
                    "--hicache-write-policy", args.write_policy],
        "radix": base,
    }
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, flags in servers.items():
        with Server(model_path, *flags) as server:
            results[name], outputs[name] = asyncio.run(run_server(server.base_url, args, prompts))
        line = {"server": name, "device_pool_tokens": device_tokens,
                "working_set_tokens": args.docs * args.doc_len, **results[name]}
        print(json.dumps(line), flush=True)
    hi, radix = results["hicache"], results["radix"]
    print(json.dumps({
        "summary": True,
        "reask_ttft_ratio": round(hi["reask_ttft_s"] / radix["reask_ttft_s"], 3),
        "reask_ttft_target": 0.3,
        "throughput_ratio": round(hi["throughput_req_s"] / radix["throughput_req_s"], 3),
        "throughput_target": 1.5,
        "same_outputs": outputs["hicache"] == outputs["radix"],
    }), flush=True)


if __name__ == "__main__":
    main()
