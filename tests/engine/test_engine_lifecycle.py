"""Engine start-up errors, child death and shutdown: nothing is left behind."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS, engine_state
from tests.sync import in_background, wait_for


def _children() -> set[int]:
    """Our child processes, without multiprocessing's own resource tracker (it stays)."""
    return {
        p.pid for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    }


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="max_tokens_total"):
        Engine(model_path="/nonexistent", max_tokens_total=5)


def test_bad_model_path_raises_value_error_before_spawning():
    before = _children()
    with pytest.raises(ValueError, match="config.json"):
        Engine(model_path="/nonexistent/model")
    assert _children() == before


def test_child_start_failure_raises_runtime_error_with_its_message(llama_path):
    before = _children()
    with pytest.raises(RuntimeError, match="scheduler process failed to start.*page"):
        Engine(model_path=str(llama_path), device="cpu", max_total_tokens=2, page_size=4)
    assert _children() == before


def test_dead_scheduler_fails_calls_and_shutdown_leaves_no_child(llama_path, strict_env):
    engine = Engine(model_path=llama_path, **ENGINE_KWARGS)  # a Path is accepted
    with engine:
        scheduler_pid, detokenizer_pid = engine.child_pids
        ipc_dir = engine.port_args.directory
        assert engine.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2
        # Paused in place, the stream cannot finish before the scheduler dies.
        engine.pause_generation("in_place")
        consumer = in_background(lambda: list(engine.generate(
            input_ids=[3, 4], stream=True, sampling_params={"max_new_tokens": 8})))
        wait_for(lambda: engine_state(engine), lambda s: s["num_waiting_reqs"] == 1,
                 "the stream queued in the paused scheduler")
        os.kill(scheduler_pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="scheduler process exited unexpectedly"):
            consumer.result(timeout=60)
        with pytest.raises(RuntimeError, match="scheduler process exited unexpectedly"):
            engine.generate("hi")
    engine.shutdown()  # idempotent
    assert not psutil.pid_exists(scheduler_pid) and not psutil.pid_exists(detokenizer_pid)
    assert not os.path.exists(ipc_dir)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hi")
