"""Engine fixtures: the children run with RADIXSERVE_TEST_STRICT=1, so a memory leak raises."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sync import STATE_TIMEOUT_S

# Small enough that no test allocates a large KV pool, large enough for every test here.
ENGINE_KWARGS: dict[str, Any] = {"device": "cpu", "max_total_tokens": 8192,
                                 "max_running_requests": 16}


@pytest.fixture(scope="module")
def strict_env() -> Iterator[None]:
    """Spawned children inherit the environment at start: set the strict leak check for them."""
    old = os.environ.get("RADIXSERVE_TEST_STRICT")
    os.environ["RADIXSERVE_TEST_STRICT"] = "1"
    yield
    if old is None:
        del os.environ["RADIXSERVE_TEST_STRICT"]
    else:
        os.environ["RADIXSERVE_TEST_STRICT"] = old


def wait_idle(engine: Any, timeout: float = STATE_TIMEOUT_S) -> dict[str, Any]:
    """Poll the scheduler until nothing runs or waits; return its internal state."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine.get_server_info()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"scheduler still busy after {timeout}s: {state}")
        time.sleep(0.05)


def engine_state(engine: Any) -> dict[str, Any]:
    return engine.get_server_info()["internal_states"][0]


@contextlib.contextmanager
def engine_paused(engine: Any, mode: str = "in_place") -> Iterator[None]:
    """Generation paused for the block; continued after it, also when the block fails."""
    engine.pause_generation(mode)
    try:
        yield
    finally:
        engine.continue_generation()
