"""Model steps of the overlap schedule (``--enable-overlap-schedule``) on one background thread.

While decode step N runs here, the scheduler thread plans step N+1 and then processes step N's
tokens (``OverlapLoop.run_step``). Step N+1 is planned before those tokens exist, so its
``input_ids`` are taken here, from step N's sampled tokens, just before its forward
(``prev_rows[i]``: the row of request i in step N). Steps run one at a time in launch order, so a
step sees every KV write of the steps launched before it. The torch ops release the GIL, so the
scheduler's Python work proceeds while a step computes.

This pays where the forward leaves the CPU free (an accelerator computes it asynchronously). On a
CPU the forward's OpenMP threads already fill every core, so the scheduler's work only takes turns
with them; worse, libgomp stops spin-waiting once OpenMP regions also run on a thread other than
the process's first (it then manages more threads than there are CPUs), and the forward's threads
sleep between regions. Measured on 2 CPUs (benchmarks/RESULTS.md): 0.5-0.9x the plain schedule's
throughput, hence off by default.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.sampler import SampleOutput
from radixserve.managers.scheduler.tp_worker import TpModelWorker


class OverlapWorker:
    """Runs ``TpModelWorker.forward_batch_generation`` off the scheduler thread, in order."""

    def __init__(self, tp_worker: TpModelWorker) -> None:
        self.tp_worker = tp_worker
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-step")
        self._last_tokens: torch.Tensor | None = None  # the previous step's, on the step thread

    def launch(
        self, forward_batch: ForwardBatch, prev_rows: torch.Tensor | None = None
    ) -> Future[SampleOutput]:
        """Queue a step. ``prev_rows`` (int64, on the batch's device): its inputs are the tokens
        the previous step samples, in these rows; None when ``input_ids`` is already set."""
        return self._thread.submit(self._run, forward_batch, prev_rows)

    def _run(self, forward_batch: ForwardBatch, prev_rows: torch.Tensor | None) -> SampleOutput:
        if prev_rows is not None:
            assert self._last_tokens is not None, "a step planned ahead follows a step"
            forward_batch.input_ids = self._last_tokens[prev_rows]
        out = self.tp_worker.forward_batch_generation(forward_batch)
        self._last_tokens = out.next_token_ids
        return out
