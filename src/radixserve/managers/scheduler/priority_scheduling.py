"""Priority scheduling (``--enable-priority-scheduling``, docs/priority.md): which waiting
request is most important, which running requests it may preempt, and which waiting requests
waited too long.

A request's ``priority`` is an integer; larger values are more important, or smaller ones with
``--schedule-low-priority-values-first`` (SGLang's convention both ways). A request that names
none gets ``--default-priority-value``, else the least important value there is, so that
every request that names a priority goes before it.

- **Order.** The waiting queue is sorted by priority, most important first; the schedule
  policy's order (arrival for ``fcfs``, cached prefix for ``lpm``) breaks ties, because the
  sort is stable.
- **Preemption.** When the most important waiting request cannot start (no request row, no
  room under ``--max-running-requests``, or not enough KV), the least important running request
  whose priority is more than ``--priority-scheduling-preemption-threshold`` below it is
  retracted (``retraction.retract_all``: its KV goes to the radix cache, its outputs are kept)
  and admission is tried again; one victim at a time, so no more are retracted than needed.
  Among equally unimportant victims the most recent goes first (it has the least to lose). The
  retracted request waits in the queue like any other and resumes where it stopped, usually
  finding its KV still cached.
- **Waiting timeout** (``RADIXSERVE_REQ_WAITING_TIMEOUT``, seconds; SGLang's
  ``SGLANG_REQ_WAITING_TIMEOUT``): a request that has waited longer than that without starting
  ends with a 503. It works with or without priority scheduling; a retracted request has
  started, so it is never timed out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from radixserve.managers.scheduler.schedule_batch import Req

# The least and most important representable priorities (int64, what crosses the processes).
_LOWEST_HIGH_FIRST = -sys.maxsize - 1
_LOWEST_LOW_FIRST = sys.maxsize

WAITING_TIMEOUT_MESSAGE = "request waiting timeout reached"


@dataclass(frozen=True)
class PriorityScheduling:
    """The priority settings, and the decisions they make."""

    low_values_first: bool = False
    preemption: bool = True  # False with --disable-priority-preemption
    threshold: int = 10  # --priority-scheduling-preemption-threshold
    default: int | None = None  # --default-priority-value

    @property
    def least_important(self) -> int:
        return _LOWEST_LOW_FIRST if self.low_values_first else _LOWEST_HIGH_FIRST

    def assign(self, req: Req, priority: int | None) -> None:
        """Set ``req``'s priority at intake (``priority``: the one it named, if any)."""
        if priority is None:
            priority = self.default if self.default is not None else self.least_important
        req.priority = priority

    def importance(self, req: Req) -> int:
        """Larger is more important, whichever convention the server uses."""
        return -req.priority if self.low_values_first else req.priority

    def order(self, waiting: list[Req]) -> None:
        """Most important first; stable, so the policy's order breaks ties."""
        waiting.sort(key=lambda r: -self.importance(r))

    def may_preempt(self, candidate: Req, running: Req) -> bool:
        """Whether ``candidate`` (waiting) is important enough to preempt ``running``."""
        return self.importance(candidate) - self.importance(running) > self.threshold

    def victim(self, candidate: Req, running: list[Req]) -> Req | None:
        """The running request ``candidate`` preempts next: the least important it may preempt,
        the most recent (fewest outputs) among equals; None when there is none."""
        if not self.preemption:
            return None
        eligible = [r for r in running if not r.finished() and self.may_preempt(candidate, r)]
        if not eligible:
            return None
        return min(eligible, key=lambda r: (self.importance(r), len(r.output_ids)))


def timed_out(waiting: list[Req], timeout_s: float, now: float) -> list[Req]:
    """The requests of ``waiting`` that waited longer than ``timeout_s`` without starting
    (``timeout_s`` <= 0: none)."""
    if timeout_s <= 0:
        return []
    return [r for r in waiting if not r.is_retracted and now - r.queued_at > timeout_s]
