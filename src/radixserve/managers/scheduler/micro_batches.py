"""The scheduler's running requests as micro-batches: ``pp_size`` of them with pipeline
parallelism (``pipeline_loop.py``), one otherwise.

Each micro-batch has its own running batch and, with pipelining, the step it still has in the
pipeline. ``current`` is the one the scheduler's ``running_batch`` refers to; the pipeline loop
selects it before each iteration. A request belongs to one micro-batch from its prefill to its
end, but every micro-batch's requests count against the scheduler's limits and hold KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.managers.scheduler.schedule_batch import Req, ScheduleBatch


@dataclass
class MicroBatch:
    """One micro-batch's running requests."""

    running: ScheduleBatch
    last_was_prefill: bool = False
    # A step of this micro-batch still in the pipeline (its result not processed yet).
    in_flight: ScheduleBatch | None = None


class MicroBatches:
    def __init__(self, count: int, make_empty: Callable[[], ScheduleBatch]) -> None:
        self.all = [MicroBatch(make_empty()) for _ in range(count)]
        self.current = self.all[0]
        # Batches launched while another micro-batch's step was still in flight.
        self.num_pipelined_steps = 0

    def select(self, index: int) -> MicroBatch:
        """Make micro-batch ``index`` the current one."""
        self.current = self.all[index]
        return self.current

    def launch(self, index: int, batch: ScheduleBatch) -> None:
        """``batch`` of micro-batch ``index`` enters the pipeline."""
        if any(mb.in_flight is not None for mb in self.all):
            self.num_pipelined_steps += 1
        self.all[index].in_flight = batch

    def take_in_flight(self, index: int) -> ScheduleBatch | None:
        """Micro-batch ``index``'s batch in the pipeline, if any, taken out of it; that
        micro-batch becomes the current one, as its result is processed next."""
        batch = self.all[index].in_flight
        if batch is not None:
            self.select(index).in_flight = None
        return batch

    def in_flight_reqs(self) -> list[Req]:
        return [r for mb in self.all if mb.in_flight for r in mb.in_flight.reqs]

    def holding_reqs(self) -> dict[int, Req]:
        """The requests of every running batch, then those of the steps in the pipeline,
        each once (by ``id``)."""
        seen: dict[int, Req] = {}
        for mb in self.all:
            for req in mb.running.reqs:
                seen[id(req)] = req
        for req in self.in_flight_reqs():
            seen.setdefault(id(req), req)
        return seen

    def others_hold_kv(self) -> bool:
        """Whether a micro-batch other than the current one holds KV (a retraction in the
        current one cannot free all of it)."""
        return any(
            mb is not self.current and (mb.in_flight is not None or not mb.running.is_empty())
            for mb in self.all
        )

    def is_empty(self) -> bool:
        return all(mb.running.is_empty() and mb.in_flight is None for mb in self.all)
