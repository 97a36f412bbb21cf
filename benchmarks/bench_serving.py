"""Online serving benchmark: streaming requests against any OpenAI-compatible server.

Sends ``--num-requests`` streaming ``/v1/completions`` requests, either as a closed loop of
``--concurrency`` clients or as Poisson arrivals at ``--request-rate`` per second (both: arrivals
at that rate, at most that many in flight), and prints one JSON object: request throughput,
output tokens/s, and TTFT / inter-token / end-to-end latency (mean, p50, p99, in ms).

Prompts are random token ids (exact ``--input-len``; the vocabulary range is ``--vocab-low`` to
``--vocab-high``) or, with ``--prompt-kind text``, random words (about ``--input-len`` tokens).
Every request asks for exactly ``--output-len`` tokens (``ignore_eos``, an extension radixserve,
SGLang and vLLM accept). Token counts come from the server's usage chunk when it sends one.
The client is aiohttp (its HTTP parser is C): on a small machine the client shares the CPUs with
the server, and a pure-Python client costs several times more CPU per streamed token.

    radixserve serve --model-path DIR &
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-requests 64 \\
        --concurrency 8 --input-len 128 --output-len 64

With ``--launch MODEL`` (``tiny``, ``small`` or a checkpoint directory) it starts the server
itself. ``--offline-baseline`` (with ``--launch``) also runs the same prompts through an
in-process ``Engine`` (``generate`` on the whole batch, no HTTP), taking turns with the served
run ``--repeats`` times, and prints one more line: the best served output tokens/s over the best
offline one (issue #5 asks at least 0.9 for 32 concurrent streams).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from bench_common import Server, resolve_model

WORDS = (
    "the of and to in is it that for on with as was at by this be from or have an are not "
    "but what all were when we there can more if out so up said about into than them its time "
    "cache tree token batch server model radix prefix memory request stream sample decode"
).split()


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, help="most requests in flight")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-kind", choices=["ids", "text"], default="ids")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--launch", metavar="MODEL",
                   help="start a server for MODEL (tiny, small or a checkpoint dir) and use it")
    p.add_argument("--dtype", default="auto", help="of the launched server and offline Engine")
    p.add_argument("--server-flags", default="",
                   help="more flags for the launched server, e.g. '--stream-interval 4'")
    # speculative decoding of the launched server (SGLang's flags, docs/speculative.md)
    for flag in SPECULATIVE_SERVER_FLAGS:
        p.add_argument(flag, help="passed to the launched server")
    p.add_argument("--offline-baseline", action="store_true",
                   help="also time the same batch on an in-process Engine (needs --launch)")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --offline-baseline: runs of each, taking turns; best is reported")
    args = p.parse_args(argv)
    if args.offline_baseline and not args.launch:
        p.error("--offline-baseline needs --launch (both must serve the same checkpoint)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 8
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be positive")
    return args


def make_prompts(args: argparse.Namespace) -> list[Any]:
    rng = random.Random(args.seed)
    if args.prompt_kind == "ids":
        return [[rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.input_len)]
                for _ in range(args.num_requests)]
    return [" ".join(rng.choices(WORDS, k=args.input_len)) for _ in range(args.num_requests)]


async def one_request(session: aiohttp.ClientSession, model: str, prompt: Any,
                      args: argparse.Namespace) -> RequestResult:
    """Stream one completion, timing each content chunk."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, start=time.perf_counter())
    last = res.start
    chunks = 0
    try:
        async with session.post("/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:  # one SSE line at a time
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    res.error = str(event["error"])
                    return res
                if event.get("usage"):
                    res.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                    res.output_tokens = event["usage"].get("completion_tokens", 0)
                if not any(c.get("text") for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - res.start
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
    except (TimeoutError, aiohttp.ClientError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - res.start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.concurrency or args.num_requests)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(base_url=args.base_url, headers=headers, timeout=timeout,
                                     connector=connector) as session:
        model = args.model
        if model is None:
            async with session.get("/v1/models") as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        prompts = make_prompts(args)
        gate = asyncio.Semaphore(args.concurrency or args.num_requests)
        rng = random.Random(args.seed + 1)

        async def gated(prompt: Any) -> RequestResult:
            async with gate:
                return await one_request(session, model, prompt, args)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if args.request_rate is not None:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"mean": round(statistics.fmean(values) * 1e3, 3),
            "p50": round(pct(0.50) * 1e3, 3), "p99": round(pct(0.99) * 1e3, 3)}


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "base_url": args.base_url,
        "model": model,
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "output_tokens_per_s": round(output_tokens / duration, 3),
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": _stats_ms([x for r in done for x in r.itls]),
        "e2e_latency_ms": _stats_ms([r.e2e for r in done if r.e2e is not None]),
        "errors": errors[:5],
    }


def run_offline(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The same prompts and sampling as the served run, as one ``Engine.generate`` batch."""
    prompts = make_prompts(args)
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    engine.flush_cache()  # as on the server, nothing starts cached
    start = time.perf_counter()
    if args.prompt_kind == "ids":
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    else:
        outs = engine.generate(prompt=prompts, sampling_params=params)
    duration = time.perf_counter() - start
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"offline": True, "num_requests": len(prompts), "duration_s": round(duration, 3),
            "output_tokens_per_s": round(output_tokens / duration, 3),
            "total_output_tokens": output_tokens}


SPECULATIVE_SERVER_FLAGS = (
    "--speculative-algorithm", "--speculative-num-draft-tokens", "--speculative-num-steps",
    "--speculative-draft-model-path", "--speculative-draft-model-quantization",
    "--speculative-max-batch-size",
)


@contextlib.contextmanager
def launched(args: argparse.Namespace) -> Iterator[Any]:
    """The server of ``--launch`` (``args.base_url`` points at it), and the offline Engine of
    ``--offline-baseline`` (else None); both idle while the other runs."""
    model_path = resolve_model(args.launch)
    with contextlib.ExitStack() as stack:
        flags = ["--dtype", args.dtype, *shlex.split(args.server_flags)]
        for flag in SPECULATIVE_SERVER_FLAGS:
            value = getattr(args, flag.removeprefix("--").replace("-", "_"))
            if value is not None:
                flags += [flag, value]
        server = stack.enter_context(Server(model_path, *flags))
        args.base_url = server.base_url
        engine = None
        if args.offline_baseline:
            from radixserve import Engine

            engine = stack.enter_context(Engine(model_path, dtype=args.dtype))
        yield engine


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.launch:
        print(json.dumps(asyncio.run(run(args))))
        return
    with launched(args) as engine:
        served, offline = [], []
        for _ in range(args.repeats):
            served.append(asyncio.run(run(args)))
            print(json.dumps(served[-1]), flush=True)
            if engine is not None:
                offline.append(run_offline(engine, args))
                print(json.dumps(offline[-1]), flush=True)
    if offline:
        best_served = max(r["output_tokens_per_s"] for r in served)
        best_offline = max(r["output_tokens_per_s"] for r in offline)
        print(json.dumps({"comparison": "served over offline output tokens/s",
                          "concurrency": args.concurrency, "served": best_served,
                          "offline": best_offline,
                          "ratio": round(best_served / best_offline, 3)}))


if __name__ == "__main__":
    main()
