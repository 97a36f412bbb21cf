"""The overlap loop (``--enable-overlap-schedule``): the scheduler's steps with the model on the
``OverlapWorker``'s thread.

While decode step N computes, step N+1 is planned and launched, then N's tokens are processed,
so the scheduler's work hides behind the forward. Whatever needs step N's outcome first (an
admission, an abort, a retraction, sampling that reads the outputs: ``can_decode_ahead``) waits
for it and then goes as the normal loop's step would; prefills run one at a time, waited for at
once.

A request that finishes at step N is already in step N+1: that step writes the KV of its last
token and samples one token more, which ``process_batch_result`` discards. Greedy outputs are
those of the normal loop.

A peer of ``NormalLoop`` and ``PipelineLoop`` (``scheduler_loop.py``): it drives the scheduler
through ``LoopScheduler`` and owns only the step in flight.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from radixserve.layers.sampler import SampleOutput
from radixserve.managers.scheduler.overlap_worker import OverlapWorker
from radixserve.managers.scheduler.retraction import decode_fits
from radixserve.managers.scheduler.schedule_batch import ScheduleBatch
from radixserve.managers.scheduler.scheduler_loop import LoopScheduler, SchedulerLoop
from radixserve.sampling.sampling_batch_info import reads_output_ids


@dataclass
class InFlight:
    """A decode step launched on the overlap worker whose result is not processed yet."""

    batch: ScheduleBatch  # a snapshot: the running batch moves on meanwhile
    result: Future[SampleOutput]


class OverlapLoop(SchedulerLoop):
    launches_ahead = True

    def __init__(
        self, scheduler: LoopScheduler, watchdog_timeout: float, worker: OverlapWorker
    ) -> None:
        super().__init__(scheduler, watchdog_timeout)
        self.worker = worker
        self.in_flight: InFlight | None = None
        self.num_steps = 0  # decode steps launched before the previous one's result

    def run_step(self) -> bool:
        """One step with the model on the worker's thread (see the module doc)."""
        scheduler = self.scheduler
        if scheduler.skip_step_paused():
            return False
        scheduler.begin_step()
        previous, self.in_flight = self.in_flight, None
        if previous is not None and self.can_decode_ahead():
            scheduler.prepare_decode_behind(previous.batch)
            self.in_flight = self._launch_decode()
            self.num_steps += 1
            self._finish(previous)
            scheduler.model_step_done()
            scheduler.check_busy_invariant()
            return True
        if previous is not None:
            self._finish(previous)
            scheduler.model_step_done()
        batch = scheduler.get_next_batch_to_run()
        if batch is None:
            return scheduler.on_idle() if previous is None else True
        scheduler.note_launch()
        if batch.forward_mode.is_extend:
            result = self.worker.launch(batch.to_forward_batch()).result()
            scheduler.process_batch_result(batch, result)
            scheduler.model_step_done()
        else:
            self.in_flight = self._launch_decode()
        scheduler.check_busy_invariant()
        return True

    @property
    def has_in_flight(self) -> bool:
        return self.in_flight is not None

    def finish_in_flight(self) -> None:
        """Wait for the step in flight, if any, and process its tokens (a pause needs
        nothing computing)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._finish(step)

    def can_decode_ahead(self) -> bool:
        """Whether the running batch's next step can be planned before the tokens of the step
        in flight are known: nothing could be admitted now (``admission_pending``), nothing
        waits to be aborted or retracted, no streaming session turn (its slot takes the turn's
        KV when it finishes) and no sampler that reads the outputs so far (penalties, seeds, a
        grammar's mask)."""
        batch = self.scheduler.running_batch
        if batch.is_empty() or self.scheduler.admission_pending():
            return False
        for req in batch.reqs:
            if req.to_abort is not None or req.streaming_session_id is not None:
                return False
            if req.grammar is not None:
                return False
            if reads_output_ids(req.sampling_params, len(req.output_ids)):
                return False
        return decode_fits(batch)

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
