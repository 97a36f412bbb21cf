"""Multi-turn chat benchmark: streaming sessions against resending the history.

``--sessions`` (S) chats run concurrently, each ``--turns`` (T) turns in sequence; every turn adds
``--new-tokens`` (U) random token ids and generates exactly ``--output-len`` (O) tokens (greedy,
``ignore_eos``), streamed so that time to first token is seen. The same chats run three ways:

- ``streaming``: a streaming session per chat (``/open_session`` with ``streaming: true``); each
  turn sends only its U new ids, the server keeps the conversation's KV in the session's slot;
- ``resend``: plain ``/generate`` requests carrying the whole history, radix cache on;
- ``resend-no-radix``: the same on a server started with ``--disable-radix-cache``.

It prints one JSON object per mode and turn index (means over the S chats): TTFT, prefill tokens
computed (``prompt_tokens - cached_tokens``), cached tokens, and output tokens/s of that turn
(all its output tokens over the span from its first request's start to its last one's end); then
one summary per mode (with `ttft_last_over_first`, the last turn's TTFT over the first one's), and a
check that every mode produced the same conversations. Each mode starts with one warm-up request
and an empty cache.

``--offload`` measures the session store instead: for each history length of ``--histories``, one
streaming session (a server with ``--session-store`` and ``--session-offload-after``) runs turns
of U new ids and O output tokens, the time to first token measured three ways, interleaved
``--reps`` times: ``resident`` (the slot in the pool), ``restore`` (after the session went idle
and its KV was offloaded to the store: the turn copies it back) and ``recompute`` (after
``flush_cache`` dropped it: the turn prefills the whole history). One JSON line per turn, one
summary per history (median TTFTs, ``restore_over_recompute``, ``resident_over_recompute``, the
stored file's size), and a last line with the issue's target (restore <= 0.3x recompute at 4k).

    # starts its own servers (tiny random model of make_bench_models.py, built on first use):
    python benchmarks/bench_sessions.py --sessions 8 --turns 6 --new-tokens 64 --output-len 32
    # or against running servers (the first started with --enable-streaming-session):
    python benchmarks/bench_sessions.py --base-url http://127.0.0.1:30000 \\
        --no-radix-base-url http://127.0.0.1:30001
    # the session store: restore vs recompute vs resident, histories of 1k-8k tokens
    python benchmarks/bench_sessions.py --offload --model small --dtype auto -U 32 -O 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_common import BENCH_MODELS, Server, resolve_model

MODES = ("streaming", "resend", "resend-no-radix")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help=f"{' or '.join(BENCH_MODELS)} (built on first use) or a checkpoint dir")
    p.add_argument("--base-url", help="a running server with --enable-streaming-session")
    p.add_argument("--no-radix-base-url", help="a running server with --disable-radix-cache")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of "
                   + ", ".join(MODES))
    p.add_argument("--sessions", "-S", type=int, default=8)
    p.add_argument("--turns", "-T", type=int, default=6)
    p.add_argument("--new-tokens", "-U", type=int, default=64, help="new ids per turn")
    p.add_argument("--output-len", "-O", type=int, default=32)
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="for the servers this script starts")
    p.add_argument("--device", default="auto", help="for the servers this script starts")
    p.add_argument("--max-total-tokens", type=int, help="for the servers this script starts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--offload", action="store_true",
                   help="measure the session store: restore vs recompute vs resident TTFT")
    p.add_argument("--histories", default="1024,2048,4096,8192",
                   help="--offload: history lengths in tokens (comma-separated)")
    p.add_argument("--reps", type=int, default=3, help="--offload: rounds of the three modes")
    p.add_argument("--offload-after", type=float, default=1.0,
                   help="--offload: the server's --session-offload-after (seconds)")
    args = p.parse_args(argv)
    args.histories = [int(h) for h in args.histories.split(",") if h]
    if args.offload and (args.base_url or args.no_radix_base_url):
        p.error("--offload starts its own server (it needs the store's directory)")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    for name in ("sessions", "turns", "new_tokens", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# ---------------------------------------------------------------------------- workload
@dataclass
class TurnResult:
    turn: int
    start: float
    end: float
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def make_chats(args: argparse.Namespace) -> list[list[list[int]]]:
    """The new ids of every turn of every chat (the same for every mode)."""
    rng = random.Random(args.seed)
    return [[[rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.new_tokens)]
             for _ in range(args.turns)] for _ in range(args.sessions)]


async def streamed_generate(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, dict]:
    """POST a streaming /generate; returns (seconds to the first token, the final chunk)."""
    start = time.perf_counter()
    ttft = None
    last: dict[str, Any] | None = None
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line.removeprefix("data: "))
            if "error" in last:
                raise RuntimeError(f"/generate failed: {last['error']}")
            if ttft is None and last["output_ids"]:
                ttft = time.perf_counter() - start
    assert last is not None and ttft is not None, "the stream carried no tokens"
    return ttft, last


async def run_chat(http: httpx.AsyncClient, mode: str, turns: list[list[int]],
                   output_len: int) -> tuple[list[TurnResult], list[int]]:
    """One chat's turns in sequence; returns per-turn results and the final conversation."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    session_id = None
    if mode == "streaming":
        r = await http.post("/open_session",
                            json={"capacity_of_str_len": 1 << 20, "streaming": True})
        if r.status_code != 200:
            raise RuntimeError(f"/open_session answered {r.status_code}: {r.text}")
        session_id = r.json()
    history: list[int] = []
    results = []
    try:
        for k, new in enumerate(turns):
            if session_id is not None:
                body = {"input_ids": new, "session_params": {"id": session_id}}
            else:
                body = {"input_ids": history + new}
            start = time.perf_counter()
            ttft, out = await streamed_generate(http, {**body, "sampling_params": params})
            meta = out["meta_info"]
            results.append(TurnResult(k, start, time.perf_counter(), ttft, meta["prompt_tokens"],
                                      meta["cached_tokens"], meta["completion_tokens"]))
            history = history + new + out["output_ids"]
    finally:
        if session_id is not None:
            await http.post("/close_session", json={"session_id": session_id})
    return results, history


async def run_mode(base_url: str, mode: str, args: argparse.Namespace,
                   chats: list[list[list[int]]]) -> tuple[list[dict], list[list[int]]]:
    limits = httpx.Limits(max_connections=2 * args.sessions + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout, limits=limits) as http:
        # One throwaway request first, so turn 0 does not pay for the server's first forward.
        await streamed_generate(http, {"input_ids": chats[0][0], "sampling_params": {
            "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}})
        r = await http.post("/flush_cache")  # every mode starts from an empty cache
        if r.status_code != 200:
            raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text}")
        start = time.perf_counter()
        done = await asyncio.gather(*(run_chat(http, mode, c, args.output_len) for c in chats))
        wall = time.perf_counter() - start
    results = [t for turns, _ in done for t in turns]
    return report(mode, results, wall), [history for _, history in done]


def report(mode: str, results: list[TurnResult], wall: float) -> list[dict[str, Any]]:
    lines = []
    for k in sorted({t.turn for t in results}):
        turn = [t for t in results if t.turn == k]
        span = max(t.end for t in turn) - min(t.start for t in turn)
        lines.append({
            "mode": mode, "turn": k, "requests": len(turn),
            "ttft_ms_mean": round(1000 * statistics.mean(t.ttft for t in turn), 2),
            "prompt_tokens_mean": round(statistics.mean(t.prompt_tokens for t in turn), 1),
            "prefill_tokens_mean": round(
                statistics.mean(t.prompt_tokens - t.cached_tokens for t in turn), 1),
            "cached_tokens_mean": round(statistics.mean(t.cached_tokens for t in turn), 1),
            "output_tokens_per_s": round(sum(t.output_tokens for t in turn) / span, 1),
        })
    lines.append({
        "mode": mode, "summary": True, "requests": len(results), "wall_s": round(wall, 3),
        "ttft_ms_mean": round(1000 * statistics.mean(t.ttft for t in results), 2),
        "prefill_tokens_total": sum(t.prompt_tokens - t.cached_tokens for t in results),
        "cached_tokens_total": sum(t.cached_tokens for t in results),
        "output_tokens_per_s": round(sum(t.output_tokens for t in results) / wall, 1),
        # issue #5's sessions target: the last turn's TTFT over the first one's
        "ttft_last_over_first": round(lines[-1]["ttft_ms_mean"] / lines[0]["ttft_ms_mean"], 3),
    })
    return lines


# ---------------------------------------------------------------------------- offload mode
OFFLOAD_MODES = ("resident", "restore", "recompute")
TARGET_HISTORY, TARGET_RATIO = 4096, 0.3  # issue #16: restore TTFT <= 0.3x recompute at 4k


async def memory(http: httpx.AsyncClient) -> dict[str, int]:
    r = await http.get("/get_server_info")
    return r.json()["internal_states"][0]["memory"]


async def wait_offloaded(http: httpx.AsyncClient, tokens: int, timeout: float) -> None:
    """Wait until the server reports ``tokens`` of session KV in the store."""
    deadline = time.monotonic() + timeout
    while (await memory(http))["session_offloaded_tokens"] < tokens:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the session was not offloaded within {timeout}s")
        await asyncio.sleep(0.05)


async def flush(http: httpx.AsyncClient) -> None:
    r = await http.post("/flush_cache")
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text}")


async def run_offload(base_url: str, args: argparse.Namespace, store: Path) -> list[dict]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(n)]

    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    lines: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as http:
        await streamed_generate(http, {"input_ids": ids(8), "sampling_params": params})
        for history_len in args.histories:
            await flush(http)
            r = await http.post("/open_session",
                                json={"capacity_of_str_len": 1 << 22, "streaming": True})
            if r.status_code != 200:
                raise RuntimeError(f"/open_session answered {r.status_code}: {r.text}")
            session = {"id": r.json()}
            first = ids(history_len)
            _, out = await streamed_generate(http, {"input_ids": first, "session_params": session,
                                                    "sampling_params": params})
            history = first + out["output_ids"]
            ttfts: dict[str, list[float]] = {m: [] for m in OFFLOAD_MODES}
            stored_bytes = 0
            for rep in range(args.reps):
                for mode in OFFLOAD_MODES:
                    if mode == "restore":
                        await wait_offloaded(http, len(history) - 1, 60 + 10 * args.offload_after)
                        stored_bytes = sum(f.stat().st_size for f in store.iterdir())
                    elif mode == "recompute":
                        await flush(http)
                    new = ids(args.new_tokens)
                    ttft, out = await streamed_generate(http, {
                        "input_ids": new, "session_params": session, "sampling_params": params,
                    })
                    meta = out["meta_info"]
                    expected = 0 if mode == "recompute" else len(history) - 1
                    if meta["cached_tokens"] != expected:
                        raise RuntimeError(f"{mode}: {meta['cached_tokens']} tokens cached, "
                                           f"expected {expected}")
                    history += new + out["output_ids"]
                    ttfts[mode].append(ttft)
                    lines.append({"history": history_len, "rep": rep, "mode": mode,
                                  "ttft_ms": round(1000 * ttft, 2),
                                  "prompt_tokens": meta["prompt_tokens"],
                                  "cached_tokens": meta["cached_tokens"]})
            await http.post("/close_session", json={"session_id": session["id"]})
            median = {m: statistics.median(v) for m, v in ttfts.items()}
            lines.append({
                "history": history_len, "summary": True, "reps": args.reps,
                **{f"{m}_ttft_ms": round(1000 * median[m], 2) for m in OFFLOAD_MODES},
                "restore_over_recompute": round(median["restore"] / median["recompute"], 3),
                "resident_over_recompute": round(median["resident"] / median["recompute"], 3),
                "stored_mb": round(stored_bytes / 2**20, 2),
            })
    return lines


def main_offload(args: argparse.Namespace) -> None:
    model_path = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="radixserve-session-store-") as store:
        flags = ["--dtype", args.dtype, "--device", args.device, "--enable-streaming-session",
                 "--session-store", store, "--session-offload-after", str(args.offload_after),
                 "--max-total-tokens",
                 str(args.max_total_tokens or 3 * (max(args.histories) + 64 * args.reps))]
        with Server(model_path, *flags) as server:
            lines = asyncio.run(run_offload(server.base_url, args, Path(store)))
    for line in lines:
        print(json.dumps(line), flush=True)
    at_target = [line for line in lines
                 if line.get("summary") and line["history"] == TARGET_HISTORY]
    if at_target:
        ratio = at_target[0]["restore_over_recompute"]
        print(json.dumps({"target": f"restore TTFT <= {TARGET_RATIO}x recompute at "
                                    f"{TARGET_HISTORY} tokens of history",
                          "ratio": ratio, "met": ratio <= TARGET_RATIO}), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.offload:
        main_offload(args)
        return
    chats = make_chats(args)
    model_path = None if args.base_url and args.no_radix_base_url else resolve_model(args.model)
    server_flags = ["--dtype", args.dtype, "--device", args.device]
    if args.max_total_tokens:
        server_flags += ["--max-total-tokens", str(args.max_total_tokens)]
    histories: dict[str, list[list[int]]] = {}

    def run(base_url: str, mode: str) -> None:
        lines, histories[mode] = asyncio.run(run_mode(base_url, mode, args, chats))
        for line in lines:
            print(json.dumps(line), flush=True)

    radix_modes = [m for m in args.modes if m != "resend-no-radix"]
    if radix_modes:
        if args.base_url:
            for mode in radix_modes:
                run(args.base_url, mode)
        else:
            with Server(model_path, *server_flags, "--enable-streaming-session") as server:
                for mode in radix_modes:
                    run(server.base_url, mode)
    if "resend-no-radix" in args.modes:
        if args.no_radix_base_url:
            run(args.no_radix_base_url, "resend-no-radix")
        elif args.base_url:
            print(json.dumps({"mode": "resend-no-radix", "skipped": "give --no-radix-base-url"}))
        else:
            with Server(model_path, *server_flags, "--disable-radix-cache") as server:
                run(server.base_url, "resend-no-radix")
    modes = list(histories)
    identical = sum(len({json.dumps(histories[m][i]) for m in modes}) == 1
                    for i in range(args.sessions))
    print(json.dumps({"comparison": "final conversations identical across modes",
                      "modes": modes, "identical": identical, "sessions": args.sessions}))


if __name__ == "__main__":
    main()
