"""The step profiler's bound: a session records at most ``MAX_PROFILE_STEPS`` steps, since its
trace is written on the scheduler's thread while every request waits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.managers.scheduler import profiler as profiler_module
from radixserve.managers.scheduler.profiler import StepProfiler

BOUND = 3


@pytest.fixture
def profiler(tmp_path, monkeypatch):
    monkeypatch.setattr(profiler_module, "MAX_PROFILE_STEPS", BOUND)
    return StepProfiler(str(tmp_path))


def step(profiler: StepProfiler) -> None:
    torch.ones(4, 4) @ torch.ones(4, 4)  # something for the trace to hold
    profiler.on_step()


def test_an_open_ended_session_stops_at_the_bound_and_stop_returns_its_trace(profiler):
    path = profiler.start(None, None, ["CPU"], False, False)
    for _ in range(BOUND - 1):
        step(profiler)
    assert profiler.active
    step(profiler)
    assert not profiler.active  # stopped by itself, the trace already on disk
    assert json.loads(Path(path).read_text())["traceEvents"]
    assert profiler.stop() == path  # the stop_profile that comes later gets it, once
    with pytest.raises(ValueError, match="no profile"):
        profiler.stop()


def test_num_steps_past_the_bound_is_refused_and_a_new_session_starts_clean(profiler):
    with pytest.raises(ValueError, match=rf"num_steps must be in \[1, {BOUND}\]"):
        profiler.start(None, BOUND + 1, ["CPU"], False, False)
    assert not profiler.active
    path = profiler.start(None, None, ["CPU"], False, False)
    for _ in range(BOUND):
        step(profiler)
    second = profiler.start(None, 1, ["CPU"], False, False)  # an unclaimed bound trace: dropped
    step(profiler)
    assert not profiler.active and path != second
    assert Path(path).exists() and Path(second).exists()
    with pytest.raises(ValueError, match="no profile"):  # a num_steps session's end is no claim
        profiler.stop()
