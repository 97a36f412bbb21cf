"""``radixserve serve`` as a process: one ready line, a graceful drain on SIGTERM, clean exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server.conftest import (
    READY_PREFIX,
    free_port,
    internal_state,
    parse_sse,
    pause_generation,
    start_server,
)
from tests.sync import in_background, wait_for


def test_sigterm_drains_in_flight_requests_then_exits_zero_without_children(llama_path):
    srv = start_server(llama_path)
    try:
        children = srv.children()
        assert len(children) >= 2  # the scheduler and the detokenizer

        def hold() -> dict:
            body = {"text": "long", "stream": True,
                    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
            with httpx.Client(base_url=srv.base_url, timeout=120) as c, \
                    c.stream("POST", "/generate", json=body) as r:
                return parse_sse(list(r.iter_lines()))[-1]["meta_info"]

        # Paused in place, the request stays in flight until the drain gives up on it.
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            pause_generation(c)
            holder = in_background(hold)
            wait_for(lambda: internal_state(c), lambda s: s["num_waiting_reqs"] == 1,
                     "the request queued in the paused scheduler")
        srv.proc.send_signal(signal.SIGTERM)
        # The drain lasts DRAIN_TIMEOUT_S (5 s): /health turns 503 within a moment of it.
        with httpx.Client(base_url=srv.base_url, timeout=10) as c:
            wait_for(lambda: {"health": c.get("/health").status_code},
                     lambda s: s["health"] == 503, "the drain started", timeout=5)
            r = c.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 503 and "Retry-After" in r.headers
        # The in-flight request was aborted when the drain timed out, and ended properly.
        assert holder.result(timeout=60)["finish_reason"]["type"] == "abort"
        assert srv.proc.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
        ready = [line for line in srv.stdout_lines if line.startswith(READY_PREFIX)]
        assert ready == [f"{READY_PREFIX}{srv.base_url} (model {srv.model})"]
    finally:
        srv.kill()


def test_sigterm_to_the_whole_process_group_exits_zero_without_an_error(llama_path, tmp_path):
    """What systemd and ``kill -TERM -PGID`` do: every process of the group gets SIGTERM. The
    children leave shutdown to the parent (they ignore it), so no child "exits unexpectedly"
    and the server drains and exits 0, as on a terminal's Ctrl-C."""
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "serve", "--model-path", str(llama_path),
             "--port", str(free_port()), "--dtype", "float32", "--device", "cpu",
             "--max-total-tokens", "4096", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(READY_PREFIX):
                    break
            children = psutil.Process(proc.pid).children(recursive=True)
            assert len(children) >= 2
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()[-3000:]
            _, alive = psutil.wait_procs(children, timeout=10)
            assert not alive
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert "exited unexpectedly" not in text and "ERROR" not in text, text[-3000:]
    assert "leaked semaphore" not in text, text[-3000:]  # (the tracker was among the children)


def test_busy_port_fails_fast_with_a_clear_error(llama_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "radixserve", "serve", "--model-path", str(llama_path),
             "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_console_script_rejects_an_invalid_choice():
    script = Path(sys.executable).parent / "radixserve"
    if not script.exists():
        pytest.skip("the radixserve console script is not installed in this environment")
    proc = subprocess.run([str(script), "serve", "--dtype", "float8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'float8'" in proc.stderr


# Starts the server (argv[1:]) and waits for it, as a test run or a script would; its stdout,
# which the server inherits, says the server's pid first.
LAUNCHER = """
import subprocess, sys
server = subprocess.Popen(sys.argv[1:])
print(f"server pid {server.pid}", flush=True)
server.wait()
"""


def _gone(proc: psutil.Process) -> bool:
    """Exited (a zombie waiting for whoever adopted it to reap it counts as exited)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_whose_parent_is_killed_stops_with_its_workers(llama_path, tmp_path):
    """A test run killed mid-way (SIGKILL: no fixture teardown, no atexit) must leave no server
    behind. With ``RADIXSERVE_EXIT_WITH_PARENT=1`` (which the suite sets) the server notices it
    was reparented, drains and stops, and its workers with it. Without it, the server serves on
    and the wait below fails at its bound."""
    cmd = [sys.executable, "-c", LAUNCHER,
           sys.executable, "-m", "radixserve", "serve", "--model-path", str(llama_path),
           "--port", str(free_port()), "--dtype", "float32", "--device", "cpu",
           "--max-total-tokens", "4096", "--log-level", "warning"]
    env = {**os.environ, "RADIXSERVE_EXIT_WITH_PARENT": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "stderr.log"
    procs: list[psutil.Process] = []
    with log.open("w") as err:
        launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                    start_new_session=True)
    try:
        assert launcher.stdout is not None
        server = psutil.Process(int(launcher.stdout.readline().split()[-1]))
        procs = [server]
        assert any(line.startswith(READY_PREFIX) for line in launcher.stdout), log.read_text()
        procs += server.children(recursive=True)
        assert len(procs) >= 3, procs  # the server, the scheduler and the detokenizer
        launcher.kill()
        assert launcher.wait(30) == -signal.SIGKILL
        wait_for(lambda: {"alive": [p.pid for p in procs if not _gone(p)]},
                 lambda s: not s["alive"], "the orphaned server and its workers exited")
        assert "the parent process" in log.read_text()
    finally:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        launcher.kill()
        launcher.wait()
