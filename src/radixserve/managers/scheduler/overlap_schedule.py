"""The overlap schedule (``--enable-overlap-schedule``): the scheduler's ``step`` when the model
runs on the ``OverlapWorker``'s thread.

While decode step N computes, step N+1 is planned and launched, then N's tokens are processed,
so the scheduler's work hides behind the forward. Whatever needs step N's outcome first (an
admission, an abort, a retraction, sampling that reads the outputs: ``can_decode_ahead``) waits
for it and then goes as the plain ``Scheduler.step`` would; prefills run one at a time, waited
for at once.

A request that finishes at step N is already in step N+1: that step writes the KV of its last
token and samples one token more, which ``process_batch_result`` discards. Greedy outputs are
those of the plain schedule.

Composed into the ``Scheduler`` (never mixed in): it drives the scheduler's own step parts
(``begin_step``, ``get_next_batch_to_run``, ``process_batch_result``) and owns only the step in
flight.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.layers.sampler import SampleOutput
from radixserve.managers.scheduler.overlap_worker import OverlapWorker
from radixserve.managers.scheduler.retraction import decode_fits
from radixserve.managers.scheduler.schedule_batch import ScheduleBatch
from radixserve.sampling.sampling_batch_info import reads_output_ids

if TYPE_CHECKING:
    from radixserve.managers.scheduler.scheduler import Scheduler


@dataclass
class InFlight:
    """A decode step launched on the overlap worker whose result is not processed yet."""

    batch: ScheduleBatch  # a snapshot: the running batch moves on meanwhile
    result: Future[SampleOutput]


class OverlapSchedule:
    def __init__(self, scheduler: Scheduler, worker: OverlapWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.in_flight: InFlight | None = None
        self.num_steps = 0  # decode steps launched before the previous one's result

    def step(self) -> bool:
        """``Scheduler.step`` with the model on the worker's thread (see the module doc)."""
        s = self.scheduler
        s.begin_step()
        previous, self.in_flight = self.in_flight, None
        if previous is not None and self.can_decode_ahead():
            s.new_token_ratio.step()
            s.running_batch.prepare_for_decode(behind=previous.batch)
            self.in_flight = self._launch_decode()
            self.num_steps += 1
            self._finish(previous)
            s.control.after_step()
            s.check_busy_invariant()
            return True
        if previous is not None:
            self._finish(previous)
            s.control.after_step()
        batch = s.get_next_batch_to_run()
        if batch is None:
            return s.on_idle() if previous is None else True
        s.idle_checked = False
        if batch.forward_mode.is_extend:
            s.process_batch_result(batch, self.worker.launch(batch.to_forward_batch()).result())
            s.control.after_step()
        else:
            self.in_flight = self._launch_decode()
        s.check_busy_invariant()
        return True

    def finish_in_flight(self) -> None:
        """Wait for the step in flight, if any, and process its tokens (a pause needs
        nothing computing)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._finish(step)

    def can_decode_ahead(self) -> bool:
        """Whether the running batch's next step can be planned before the tokens of the step
        in flight are known: nothing could be admitted now (the waiting requests wait for a
        request slot, which only a finish frees), nothing waits to be aborted or retracted, no
        streaming session turn (its slot takes the turn's KV when it finishes) and no sampler
        that reads the outputs so far (penalties, seeds, a grammar's mask)."""
        s = self.scheduler
        batch = s.running_batch
        if batch.is_empty() or s.chunked_req is not None:
            return False
        if s.waiting_queue and self._could_admit_now():
            return False
        for req in batch.reqs:
            if req.to_abort is not None or req.streaming_session_id is not None:
                return False
            if req.grammar is not None:
                return False
            if reads_output_ids(req.sampling_params, len(req.output_ids)):
                return False
        return decode_fits(batch)

    def _could_admit_now(self) -> bool:
        """Whether a waiting request may find a request row: one is free below
        ``max_running_requests``, or an idle streaming session's row could be released."""
        s = self.scheduler
        if len(s.running_batch) >= s.max_running_requests:
            return False
        return s.req_to_token_pool.available_size() > 0 or s.tree_cache.session_held_rows() > 0

    def _launch_decode(self) -> InFlight:
        """Launch the running batch's prepared decode step."""
        batch = self.scheduler.running_batch
        for req in batch.reqs:
            req.tokens_in_flight += 1
        forward_batch = batch.to_forward_batch()
        return InFlight(batch.snapshot(), self.worker.launch(forward_batch, batch.input_rows))

    def _finish(self, step: InFlight) -> None:
        """Wait for the step and process its tokens."""
        result = step.result.result()
        self.scheduler.process_batch_result(step.batch, result)
        for req in step.batch.reqs:
            req.tokens_in_flight -= 1
