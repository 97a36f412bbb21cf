"""How much of the machine's CPU other processes (and, in a VM, other guests) use: so that a
kernel timing taken while something else ran is not trusted for good.

Why: the kernel dispatch (``kernel_dispatch``, ``attention/extend_dispatch``) times candidates
once per machine and caches the result. A timing taken under load is a different contest (a
thread descheduled in a oneDNN barrier, a stalled call 50x its idle time), and a cache written
under load outlived it: a table measured at load 20 gave 1.11x ``transformers`` where a quiet
measurement gave 1.58x (``benchmarks/RESULTS.md``, issue 38). A server's own start is such a
load too: its detokenizer and tokenizer processes import torch while the scheduler measures.

- ``Busy``: a window over ``/proc/stat``: the machine's busy time (user, nice, system, irq,
  softirq and steal, the time a hypervisor gave this guest's CPUs to another) minus this
  process's own (``os.times``), as CPUs' worth over the window's wall time. A window too short
  for the kernel's 10 ms tick, or a system without ``/proc/stat``, says ``None`` (cannot tell).
- ``wait_until_quiet``: before measuring, wait (bounded) for a window with others below
  ``OTHERS_BUSY_CPUS``.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

OTHERS_BUSY_CPUS = 0.5  # others using more than this many CPUs: the machine is busy
MIN_WINDOW_S = 0.05  # shorter windows are within the tick's resolution: no verdict
QUIET_WINDOW_S = 0.1
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (not idle, iowait)


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    if len(fields) < 8:
        return None
    return sum(int(fields[i]) for i in _BUSY_FIELDS) * _TICK_S


def _own_busy_s() -> float:
    t = os.times()
    return t.user + t.system


class Busy:
    """A window: ``others_cpus()`` once it has ended (``with Busy() as b: ...``)."""

    def __enter__(self) -> Busy:
        self._start = (time.perf_counter(), _machine_busy_s(), _own_busy_s())
        self._end: tuple[float, float | None, float] | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = (time.perf_counter(), _machine_busy_s(), _own_busy_s())

    def others_cpus(self) -> float | None:
        """CPUs' worth of time others used over the window; None where it cannot tell."""
        assert self._end is not None, "the window has not ended"
        (w0, m0, o0), (w1, m1, o1) = self._start, self._end
        if m0 is None or m1 is None or w1 - w0 < MIN_WINDOW_S:
            return None
        return max(0.0, (m1 - m0) - (o1 - o0)) / (w1 - w0)

    @property
    def busy(self) -> bool:
        others = self.others_cpus()
        return others is not None and others > OTHERS_BUSY_CPUS


class LoadProbe(Protocol):
    """What the dispatch asks of the machine (tests inject their own)."""

    def window(self) -> Busy: ...
    def quiet(self) -> bool: ...
    def wait_until_quiet(self, max_s: float) -> bool: ...


class MachineLoad:
    """The real machine's ``LoadProbe``."""

    def window(self) -> Busy:
        return Busy()

    def quiet(self) -> bool:
        """One short window: True when others stayed under the threshold (or we cannot tell)."""
        with Busy() as b:
            time.sleep(QUIET_WINDOW_S)
        return not b.busy

    def wait_until_quiet(self, max_s: float) -> bool:
        """Short windows until a quiet one, for at most ``max_s``; whether one came."""
        deadline = time.perf_counter() + max_s
        while not self.quiet():
            if time.perf_counter() >= deadline:
                return False
        return True
