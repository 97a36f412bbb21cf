"""``bench_offline_throughput.py --step-overhead``: what a decode step of the scheduler costs
around the model. The model is replaced by one that returns zero logits of its shape and dtype,
so each ``Scheduler.step()`` times the batch's bookkeeping, the sampler and the output path
alone (in this process: no ZMQ, no other process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


class _ZeroLogits(torch.nn.Module):
    """Stands in for the model in ``--step-overhead``: zero logits of the model's shape and
    dtype (the sampler's cost depends on both)."""

    def __init__(self, vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.dtype = dtype

    def forward(self, forward_batch: Any, previous_stage: Any = None) -> torch.Tensor:
        return torch.zeros(forward_batch.batch_size, self.vocab_size, dtype=self.dtype)


def run_step_overhead(args: argparse.Namespace, model_path: str,
                      decode: dict[int, list[list[int]]], output_len: int,
                      ) -> list[dict[str, Any]]:
    """Median wall time of one decode ``Scheduler.step()`` with the model stubbed out, for each
    batch of ``decode`` (batch size -> prompts) generating ``output_len`` tokens."""
    from radixserve.managers.io_struct import TokenizedGenerateReqInput
    from radixserve.managers.scheduler.scheduler_builder import build_scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    sent: list[Any] = []
    sa = ServerArgs(model_path=model_path, dtype=args.dtype, device="cpu",
                    max_running_requests=max(args.batch_sizes), max_total_tokens=1 << 16)
    scheduler = build_scheduler(sa, sent.append, sent.append)
    runner = scheduler.tp_worker.model_runner
    runner.model = _ZeroLogits(runner.vocab_size, runner.dtype)
    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    records = []
    for b, prompts in decode.items():
        scheduler.process_input_requests([
            TokenizedGenerateReqInput(rid=f"overhead-{b}-{i}", input_ids=p,
                                      sampling_params=params)
            for i, p in enumerate(prompts)])
        step_s: list[float] = []
        while True:
            decoding = not scheduler.waiting_queue and len(scheduler.running_batch) == b
            start = time.perf_counter()
            if not scheduler.step():
                break
            if decoding:
                step_s.append(time.perf_counter() - start)
        records.append({"backend": "radixserve", "scenario": "step_overhead", "batch_size": b,
                        "decode_steps": len(step_s),
                        "ms_per_step": round(1e3 * statistics.median(step_s), 3)})
        print(json.dumps(records[-1]), flush=True)
    return records
