"""Tensor and pipeline parallelism against one process, on this machine, plus the modelled
communication of each on a multi-GPU node.

    .venv/bin/python benchmarks/bench_parallel.py --model small [--topologies tp1,tp2,pp2]

Measured: each topology is an ``Engine`` on the same checkpoint (greedy, EOS ignored, the cache
flushed before every run); all are loaded at once and take turns within each scenario, so a burst
of load from other processes hits them alike; best of ``--repeats``. On one machine the ranks
share its cores: ``tp1`` runs one scheduler with every allowed CPU, ``tp2``/``pp2`` two
schedulers with half each. Scenarios: decode at ``--batch-sizes`` (output tokens/s) and one
``--prefill-len`` prompt (tokens/s). Each record carries the load average around it.

Modelled: bytes each rank sends per token (``comm_per_token``), from the checkpoint's shape:

    tensor parallel, N ranks    per layer two all-reduces of the hidden state (after attention and
                                after the MLP), one for the embedding, one all-gather of the
                                logits per sampled token; a ring all-reduce sends 2(N-1)/N of
                                the tensor per rank, an all-gather (N-1)/N
    pipeline parallel, P stages (P-1) hand-offs of hidden state and residual per token, and the
                                sampled token id back round the stages

Prints one JSON object per line: the records, the ratios to ``tp1``, the model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline_throughput import decode_record, prefill_record  # noqa: E402
from make_bench_models import resolve_model  # noqa: E402

TOPOLOGIES = {
    "tp1": {},
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2},
    "dp2": {"dp_size": 2},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="tiny, small, or a checkpoint directory")
    p.add_argument("--topologies", default="tp1,tp2,pp2")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512, help="0 skips the prefill scenario")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.topologies = [t for t in args.topologies.split(",") if t]
    unknown = set(args.topologies) - set(TOPOLOGIES)
    if unknown or "tp1" not in args.topologies:
        p.error(f"topologies are among {sorted(TOPOLOGIES)} and include tp1")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def comm_per_token(config: Any, tp: int, pp: int, dtype_bytes: int) -> dict[str, Any]:
    """Bytes one rank sends per token (decode: every token is sampled)."""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    out: dict[str, Any] = {"model": config.architecture, "hidden_size": hidden,
                           "layers": layers, "vocab_size": vocab, "dtype_bytes": dtype_bytes}
    if tp > 1:
        reduce = 2 * (tp - 1) / tp * hidden * dtype_bytes
        gather = (tp - 1) / tp * vocab * dtype_bytes
        out.update(
            tp=tp,
            tp_all_reduces_per_token=2 * layers + 1,
            tp_bytes_per_token=round((2 * layers + 1) * reduce + gather),
            tp_logits_share=round(gather / ((2 * layers + 1) * reduce + gather), 3),
        )
    if pp > 1:
        out.update(pp=pp, pp_handoffs_per_token=pp - 1,
                   pp_bytes_per_token_per_boundary=2 * hidden * dtype_bytes + 8)
    return out


def main() -> None:
    args = parse_args()
    label, path = resolve_model(args.model)
    from radixserve import Engine
    from radixserve.model_config import ModelConfig

    config = ModelConfig.from_path(path, dtype=args.dtype, device="cpu")
    rng = random.Random(args.seed)
    vocab = min(config.vocab_size, 8192)  # ids the benchmark tokenizer knows
    decode = {b: [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(b)]
              for b in args.batch_sizes}
    prefill = [rng.randrange(10, vocab) for _ in range(args.prefill_len)]
    params = {"temperature": 0.0, "ignore_eos": True}
    engines = {}
    try:
        for name in args.topologies:
            engines[name] = Engine(path, dtype=args.dtype, device="cpu",
                                   max_running_requests=max(args.batch_sizes),
                                   max_total_tokens=8192, **TOPOLOGIES[name])
            engines[name].generate(input_ids=[[11] * 8], sampling_params={"max_new_tokens": 2})

        def run(name: str, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
            engines[name].flush_cache()
            start = time.perf_counter()
            outs = engines[name].generate(input_ids=prompts,
                                          sampling_params={**params, "max_new_tokens": n})
            return [o["output_ids"] for o in outs], time.perf_counter() - start

        best: dict[tuple[str, str, int], dict[str, Any]] = {}
        for _ in range(args.repeats):
            for b, prompts in decode.items():
                for name in args.topologies:
                    load = os.getloadavg()[0]
                    _, first = run(name, prompts, 1)
                    outs, wall = run(name, prompts, args.output_len)
                    rec = decode_record(name, prompts, outs, wall, first)
                    rec["load_avg_1m"] = round((load + os.getloadavg()[0]) / 2, 2)
                    key = (name, "decode", b)
                    if key not in best or rec["wall_s"] < best[key]["wall_s"]:
                        best[key] = rec
            if args.prefill_len:
                for name in args.topologies:
                    load = os.getloadavg()[0]
                    _, wall = run(name, [prefill], 1)
                    rec = prefill_record(name, prefill, wall)
                    rec["load_avg_1m"] = round((load + os.getloadavg()[0]) / 2, 2)
                    key = (name, "prefill", 1)
                    if key not in best or rec["wall_s"] < best[key]["wall_s"]:
                        best[key] = rec
    finally:
        for engine in engines.values():
            engine.shutdown()
    for rec in best.values():
        print(json.dumps({"model": label, **rec}), flush=True)
    for (name, scenario, b), rec in best.items():
        if name == "tp1":
            continue
        base = best[("tp1", scenario, b)]
        metric = "output_tokens_per_s" if scenario == "decode" else "prefill_tokens_per_s"
        print(json.dumps({"ratio": f"{name}/tp1", "scenario": scenario, "batch_size": b,
                          "value": round(rec[metric] / base[metric], 3)}), flush=True)
    dtype_bytes = config.torch_dtype.itemsize
    print(json.dumps({"modelled": comm_per_token(config, tp=2, pp=2, dtype_bytes=dtype_bytes)}))


if __name__ == "__main__":
    main()
