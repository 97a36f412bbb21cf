"""The prefill of a batch of prompts on CPU: where radixserve's time goes, before and after the
kernel dispatch, next to ``transformers`` on the same prompts, in one process and one run.

The prompts are ``bench_offline_throughput.py``'s decode workload at each ``--batch-sizes`` B (B
random prompts of ``--min/--max-input-len`` tokens, same seed), each generating one token, so
the wall time is the prefill (the batch's forward in chunks of ``--chunked-prefill-size``) and
one sampling. Configurations, taking turns within each repeat (a burst of load from other
processes hits them alike), best of ``--repeats``:

- ``before``: the kernels main ran before the dispatch (issue 38): the AMX kernel up to 32 rows
  and the blocked kernel above (where the CPU has AMX; the blocked kernel everywhere otherwise),
  and radixserve's extend attention kernel for every request;
- ``after``: what the engine chose at start-up (``--cpu-kernel-autotune on``: measured and cached,
  ``layers/kernel_dispatch.py`` and ``layers/attention/extend_dispatch.py``);
- ``transformers``: ``generate(max_new_tokens=1)`` on the left-padded batch.

radixserve's scheduler runs in this process (``build_scheduler``, as ``--step-overhead`` does),
so ``--profile`` can record each configuration's last repeat with torch's profiler and print its
``--top`` operators by self CPU time. Prints one JSON line per batch size and configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_offline_throughput import _random_prompt
from make_bench_models import resolve_model

from radixserve.layers import cpu_kernels
from radixserve.layers import kernel_dispatch as kd
from radixserve.layers.attention import extend_dispatch as xd
from radixserve.layers.packed_weight import MultiKernelWeight


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", default="16,64",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--min-input-len", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=128)
    p.add_argument("--chunked-prefill-size", type=int, default=4096)
    p.add_argument("--configs", default="before,after,transformers")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def before_table(weight: MultiKernelWeight) -> tuple[str, ...]:
    """Main's choice before the dispatch: AMX up to 32 rows where it takes the weight, blocked
    above (the int8 VNNI kernel for int8 weights)."""
    return tuple(
        next(n for n in (kd.AMX, kd.INT8_VNNI, kd.BLOCKED)
             if n in weight.candidates and (n != kd.AMX or kd.ROW_BUCKETS[b] <= 32))
        for b in range(len(kd.ROW_BUCKETS))
    )


class Radixserve:
    """The scheduler and model in this process, with the kernel tables of each configuration."""

    def __init__(self, model_path: str, args: argparse.Namespace) -> None:
        from radixserve.managers.scheduler.scheduler_builder import build_scheduler
        from radixserve.server_args import ServerArgs

        sent: list[Any] = []
        server_args = ServerArgs(model_path=model_path, dtype=args.dtype, device="cpu",
                                 max_running_requests=max(args.batch_sizes),
                                 max_total_tokens=max(args.batch_sizes) * (args.max_input_len + 8),
                                 chunked_prefill_size=args.chunked_prefill_size)
        self.scheduler = build_scheduler(server_args, sent.append, sent.append)
        runner = self.scheduler.tp_worker.model_runner
        self.weights = [m for m in runner.model.modules() if isinstance(
            getattr(m, "packed", None), MultiKernelWeight)]
        self.backend = runner.attn_backend
        self.tables = {
            "after": ([m.packed.table for m in self.weights], self.backend.extend_table),
            "before": ([before_table(m.packed) for m in self.weights],
                       (xd.NATIVE,) * xd.NUM_CELLS),
        }
        self.calls = 0

    def generate(self, config: str, prompts: list[list[int]]) -> float:
        from radixserve.managers.io_struct import TokenizedGenerateReqInput
        from radixserve.sampling.sampling_params import SamplingParams

        linear, attention = self.tables[config]
        for module, table in zip(self.weights, linear, strict=True):
            module.packed.set_table(table)
        self.backend.extend_table = attention
        self.scheduler.flush()  # nothing may start cached
        self.calls += 1
        params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
        self.scheduler.process_input_requests([
            TokenizedGenerateReqInput(rid=f"p{self.calls}-{i}", input_ids=p, sampling_params=params)
            for i, p in enumerate(prompts)])
        start = time.perf_counter()
        while self.scheduler.step():
            pass
        return time.perf_counter() - start


def transformers_generate(model_path: str, dtype: str) -> Callable[[list[list[int]]], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()

    def generate(prompts: list[list[int]]) -> float:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=1, min_new_tokens=1, pad_token_id=0)
        return time.perf_counter() - start

    return generate


@contextlib.contextmanager
def profiled(on: bool, top: int, record: dict[str, Any]) -> Iterator[None]:
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    record["profile_self_ms"] = {e.key: round(e.self_cpu_time_total / 1e3, 1)
                                 for e in events[:top]}
    record["profile_total_ms"] = round(total / 1e3, 1)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.load_cpu_kernels():
        raise SystemExit("radixserve's CPU kernels do not run here: nothing to compare")
    label, model_path = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # prompt ids inside the tokenizer, no special ones (as bench_offline_throughput.py)
    allowed = [t for t in range(len(tokenizer)) if t not in set(tokenizer.all_special_ids)]
    rng = random.Random(args.seed)
    workload = {b: [_random_prompt(rng, allowed, rng.randint(args.min_input_len,
                                                             args.max_input_len))
                    for _ in range(b)] for b in args.batch_sizes}
    configs = args.configs.split(",")
    ours = Radixserve(model_path, args) if {"before", "after"} & set(configs) else None
    run: dict[str, Callable[[list[list[int]]], float]] = {
        c: (lambda p, c=c: ours.generate(c, p)) for c in configs if c in ("before", "after")}
    if "transformers" in configs:
        run["transformers"] = transformers_generate(model_path, args.dtype)
    for generate in run.values():
        generate([[3] * 16, [4] * 12])  # warm-up
    for b, prompts in workload.items():
        records = {c: {"model": label, "dtype": args.dtype, "threads": torch.get_num_threads(),
                       "batch_size": b, "prompt_tokens": sum(map(len, prompts)), "config": c,
                       "wall_s": float("inf")} for c in run}
        for repeat in range(args.repeats):
            for config, generate in run.items():
                with profiled(args.profile and repeat == args.repeats - 1, args.top,
                              records[config]):
                    wall = generate(prompts)
                records[config]["wall_s"] = round(min(records[config]["wall_s"], wall), 3)
        for record in records.values():
            record["prompt_tokens_per_s"] = round(record["prompt_tokens"] / record["wall_s"], 1)
            if "transformers" in records and record["config"] != "transformers":
                record["vs_transformers"] = round(
                    records["transformers"]["wall_s"] / record["wall_s"], 2)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
