"""The load probe the kernel dispatch trusts its timings by, on this machine's ``/proc/stat``."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from radixserve.layers import cpu_contention

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")


def _spin(started, stop) -> None:
    started.set()
    while not stop.is_set():
        pass


def test_another_process_spinning_makes_the_window_busy():
    ctx = multiprocessing.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_spin, args=(started, stop))
    child.start()
    try:
        assert started.wait(60)
        with cpu_contention.Busy() as window:
            time.sleep(0.5)  # we idle, the child spins: one CPU's worth of someone else
        others = window.others_cpus()
        assert others is not None and others > cpu_contention.OTHERS_BUSY_CPUS, others
        assert window.busy and not cpu_contention.MachineLoad().quiet()
    finally:
        stop.set()
        child.join(30)


def test_our_own_work_is_not_counted_and_a_tick_short_window_has_no_verdict():
    with cpu_contention.Busy() as short:
        pass
    assert short.others_cpus() is None and not short.busy
    machine_before, own_before = cpu_contention._machine_busy_s(), cpu_contention._own_busy_s()
    wall_before = time.perf_counter()
    with cpu_contention.Busy() as ours:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:  # this process's own time, however much it gets
            pass
    wall = time.perf_counter() - wall_before
    machine_cpus = (cpu_contention._machine_busy_s() - machine_before) / wall
    own_cpus = (cpu_contention._own_busy_s() - own_before) / wall
    others = ours.others_cpus()
    # the machine saw our spin; the window counted it as ours, not someone else's (whatever
    # share of a CPU the spin got on this machine at this moment)
    assert others is not None and own_cpus > 0.0, (others, own_cpus)
    assert abs((machine_cpus - others) - own_cpus) < 0.15, (machine_cpus, others, own_cpus)
