"""The scheduler's loops, as peers behind one interface (docs/architecture.md §4).

A scheduler process runs one of three loops, chosen once by ``build_scheduler``:

    NormalLoop    (this module)            plan a batch, run it, process its result
    OverlapLoop   (``overlap_schedule.py``) ``--enable-overlap-schedule``: decode step N+1 is
                                           launched before step N's tokens are processed
    PipelineLoop  (``pipeline_loop.py``)   ``--pp-size`` > 1: one micro-batch per iteration

Each is a ``SchedulerLoop``: ``run_step`` runs one step (tests drive it through
``Scheduler.step``), ``run_forever`` is the process's loop. A loop drives the scheduler only
through ``LoopScheduler``, the narrow set of ``Scheduler`` methods below; the scheduler knows its
loop only as a ``SchedulerLoop`` (to finish a step in flight before a flush or a pause). Neither
module imports the other's class: this module imports no scheduler module but the batch types.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.managers.scheduler.watchdog import Watchdog

if TYPE_CHECKING:
    import torch

    from radixserve.layers.sampler import SampleOutput
    from radixserve.managers.scheduler.micro_batches import MicroBatches
    from radixserve.managers.scheduler.request_receiver import RequestReceiver
    from radixserve.managers.scheduler.schedule_batch import ScheduleBatch

# How long an idle loop blocks on its socket before looking around again.
IDLE_POLL_MS = 1000


class LoopScheduler(Protocol):
    """What a loop may call on the ``Scheduler`` (each method's doc is on the scheduler)."""

    stop_requested: bool
    micro_batches: MicroBatches  # the pipeline loop selects and launches micro-batches

    @property
    def running_batch(self) -> ScheduleBatch: ...

    # every loop
    def process_input_requests(self, msgs: list[Any]) -> None: ...
    def report_load(self) -> None: ...
    def persist_sessions(self) -> None: ...
    def skip_step_paused(self) -> bool: ...
    def begin_step(self) -> None: ...
    def get_next_batch_to_run(self) -> ScheduleBatch | None: ...
    def run_batch(self, batch: ScheduleBatch) -> SampleOutput | torch.Tensor | None: ...
    def note_launch(self) -> None: ...
    def model_step_done(self) -> None: ...
    def process_batch_result(
        self, batch: ScheduleBatch, result: SampleOutput | torch.Tensor
    ) -> None: ...
    def on_idle(self) -> bool: ...
    def check_busy_invariant(self) -> None: ...

    # the overlap loop
    def admission_pending(self) -> bool: ...
    def prepare_decode_behind(self, previous: ScheduleBatch) -> None: ...


class SchedulerLoop(ABC):
    """One way of running the scheduler's steps; see the module doc."""

    # Micro-batch iterations per round of ``run_forever`` (pipeline: one per micro-batch).
    steps_per_round = 1
    # Decode steps launched before the previous one's result was processed (overlap only).
    num_steps = 0
    # Whether a step may still compute between two ``run_step`` calls (overlap only).
    launches_ahead = False

    def __init__(self, scheduler: LoopScheduler, watchdog_timeout: float) -> None:
        self.scheduler = scheduler
        self.watchdog_timeout = watchdog_timeout

    @abstractmethod
    def run_step(self) -> bool:
        """Run one step; False when there was nothing to run or generation is paused."""

    def run_forever(self, receiver: RequestReceiver) -> None:
        """Run until the scheduler's ``stop_requested``; an idle round blocks on the input
        instead of spinning. The watchdog ends the process if one step hangs for
        ``--watchdog-timeout`` seconds. On a stop, streaming sessions are written to the session
        store (``--session-store``), so that a restarted server resumes them."""
        scheduler = self.scheduler
        watchdog = Watchdog(self.watchdog_timeout)
        watchdog.start()
        while not scheduler.stop_requested:
            busy = False
            for _ in range(self.steps_per_round):
                scheduler.process_input_requests(receiver.recv())
                watchdog.step_started()
                busy |= self.run_step()
                watchdog.step_finished()
            scheduler.report_load()
            if not busy:
                self.on_idle_round()
                receiver.wait(IDLE_POLL_MS)
        scheduler.persist_sessions()

    def on_idle_round(self) -> None:  # noqa: B027 (most loops have nothing to add)
        """A round launched nothing (``run_step`` of the normal and overlap loops has already
        done the idle work)."""

    def summary(self) -> dict[str, Any]:
        """What this loop adds to the scheduler's internal state (the speculative loop: its
        acceptance figures)."""
        return {}

    @property
    def has_in_flight(self) -> bool:
        """Whether a step launched by this loop has not been processed yet."""
        return False

    def finish_in_flight(self) -> None:  # noqa: B027 (most loops leave no step in flight)
        """Wait for the step in flight, if any, and process its tokens (only the overlap loop
        leaves one between steps)."""


class NormalLoop(SchedulerLoop):
    """The plain loop: each step plans a batch, runs it and processes its result."""

    def run_step(self) -> bool:
        scheduler = self.scheduler
        if scheduler.skip_step_paused():
            return False
        scheduler.begin_step()
        batch = scheduler.get_next_batch_to_run()
        if batch is None:
            return scheduler.on_idle()
        result = self.forward(batch)
        assert result is not None, "without pipelining every rank has the step's outcome"
        scheduler.process_batch_result(batch, result)
        scheduler.check_busy_invariant()
        return True

    def forward(self, batch: ScheduleBatch) -> Any:
        """The model step of ``batch`` (a loop that runs some steps otherwise overrides it)."""
        return self.scheduler.run_batch(batch)
