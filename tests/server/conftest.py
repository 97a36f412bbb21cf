"""Real ``radixserve serve`` subprocesses for the HTTP tests.

``start_server`` launches ``python -m radixserve serve`` on a free loopback port (fp32, CPU, a
small KV pool, ``RADIXSERVE_TEST_STRICT=1`` so a memory leak crashes the scheduler) and waits for
the ready line. ``ServerProcess.stop`` sends SIGTERM and checks what every server must do on it:
exit code 0, exactly one ready line, no child process left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.sync import STATE_TIMEOUT_S

READY_PREFIX = "radixserve ready: "
START_TIMEOUT_S = 240.0
KV_TOKENS = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess: its URL, stdout lines, stderr log, and a clean stop."""

    def __init__(
        self, model_path: Path, extra_args: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_path)
        self.stdout_lines: list[str] = []
        self._final_stderr = ""
        self._ready = threading.Event()
        self._stderr = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="radixserve-test-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable, "-m", "radixserve", "serve",
            "--model-path", self.model,
            "--port", str(self.port),
            "--dtype", "float32",
            "--device", "cpu",
            "--max-total-tokens", str(KV_TOKENS),
            "--log-level", "warning",
            *extra_args,
        ]
        env = {**os.environ, "RADIXSERVE_TEST_STRICT": "1", "PYTHONUNBUFFERED": "1",
               "RADIXSERVE_EXIT_WITH_PARENT": "1", **(env or {})}  # no orphan when we are killed
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env
        )
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            if line.startswith(READY_PREFIX):
                self._ready.set()

    def stderr_tail(self, n: int = 40) -> str:
        log = Path(self._stderr.name)
        text = log.read_text(errors="replace") if log.exists() else self._final_stderr
        return "\n".join(text.splitlines()[-n:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"server did not become ready (exit code {self.proc.returncode}):\n"
                    + self.stderr_tail()
                )

    def kill(self) -> None:
        """SIGKILL the server and its children (after a failure), and clean up."""
        try:
            procs = [psutil.Process(self.proc.pid), *self.children()]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        self.stop()

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM; return the exit code after checking that no child is left."""
        if self.proc.poll() is None:
            children = self.children()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
            _, alive = psutil.wait_procs(children, timeout=10)
            assert not alive, f"child processes left after SIGTERM: {alive}"
        self._reader.join(5)
        self._stderr.close()
        log = Path(self._stderr.name)
        if log.exists():
            self._final_stderr = log.read_text(errors="replace")
            log.unlink()
        return self.proc.returncode

    def check_clean_stop(self) -> None:
        code = self.stop()
        ready = [line for line in self.stdout_lines if line.startswith(READY_PREFIX)]
        assert code == 0, f"exit code {code}:\n{self.stderr_tail()}"
        assert ready == [f"{READY_PREFIX}{self.base_url} (model {self.model})"], self.stdout_lines


def start_server(
    model_path: Path, *extra_args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """``env``: variables for the server on top of this process's environment."""
    server = ServerProcess(model_path, list(extra_args), env)
    server.wait_ready()
    return server


def internal_state(client: httpx.Client) -> dict:
    """The scheduler's live state (memory, queues, ``paused``) from ``/get_server_info``."""
    r = client.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def pause_generation(client: httpx.Client, mode: str = "in_place") -> None:
    r = client.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200, r.text


def continue_generation(client: httpx.Client) -> None:
    """A no-op when not paused: safe in a ``finally``."""
    r = client.post("/continue_generation")
    assert r.status_code == 200, r.text


@contextlib.contextmanager
def paused(client: httpx.Client, mode: str = "in_place") -> Iterator[None]:
    """Generation paused for the block; continued after it, also when the block fails, so
    that a shared server keeps serving the next tests."""
    pause_generation(client, mode)
    try:
        yield
    finally:
        continue_generation(client)


def memory_figures(client: httpx.Client) -> dict[str, int]:
    state = internal_state(client)
    return {**state["memory"], "running": state["num_running_reqs"],
            "waiting": state["num_waiting_reqs"], "aborted": state["num_aborted_reqs"]}


def assert_no_leak(client: httpx.Client, timeout: float = STATE_TIMEOUT_S) -> dict[str, int]:
    """Wait until the scheduler is idle, then check the memory invariant
    (docs/architecture.md §3)."""
    deadline = time.monotonic() + timeout
    while True:
        m = memory_figures(client)
        held = (m["available_kv_tokens"] + m["evictable_kv_tokens"]
                + m["protected_kv_tokens"] + m["session_held_kv_tokens"])
        idle = m["running"] == 0 and m["waiting"] == 0
        ok = (held == m["total_kv_tokens"] and m["protected_kv_tokens"] == 0
              and m["free_req_slots"] == m["total_req_slots"])
        if idle and ok:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle or leaking KV after {timeout}s: {m}")
        time.sleep(0.05)


# A random-weight model may loop on whitespace inside JSON: bound each run (constrained tests).
CONSTRAINED_FLAGS = ("--constrained-json-max-whitespace-cnt", "2")


@pytest.fixture(scope="session")
def server(llama_path: Path):
    """The shared server (tiny Llama, default flags but bounded JSON whitespace) for the API
    test modules."""
    srv = start_server(llama_path, *CONSTRAINED_FLAGS)
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def client(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def parse_sse(lines: list[str]) -> list:
    """The JSON payloads of an SSE body; asserts it ends with ``data: [DONE]``."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", f"stream did not end with [DONE]: {data[-3:]}"
    return [json.loads(d) for d in data[:-1]]
