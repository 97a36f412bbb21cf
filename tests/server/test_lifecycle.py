"""``radixserve serve`` as a process: one ready line, a graceful drain on SIGTERM, clean exit."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server.conftest import READY_PREFIX, free_port, parse_sse, start_server


def test_sigterm_drains_in_flight_requests_then_exits_zero_without_children(llama_path):
    srv = start_server(llama_path)
    try:
        children = srv.children()
        assert len(children) >= 2  # the scheduler and the detokenizer
        result: dict = {}
        first_chunk = threading.Event()

        def hold() -> None:
            body = {"text": "long", "stream": True,
                    "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
            with httpx.Client(base_url=srv.base_url, timeout=60) as c, \
                    c.stream("POST", "/generate", json=body) as r:
                lines = r.iter_lines()
                head = next(lines)
                first_chunk.set()
                result["last"] = parse_sse([head, *lines])[-1]["meta_info"]

        holder = threading.Thread(target=hold)
        holder.start()
        assert first_chunk.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=srv.base_url, timeout=10) as c:
            deadline = time.monotonic() + 5
            while c.get("/health").status_code == 200:  # the drain starts within a moment
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert c.get("/health").status_code == 503
            r = c.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 503 and "Retry-After" in r.headers
        holder.join(60)
        # The in-flight stream ended properly: finished, or aborted after the drain timeout.
        assert result["last"]["finish_reason"]["type"] in ("length", "abort")
        assert srv.proc.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
        ready = [line for line in srv.stdout_lines if line.startswith(READY_PREFIX)]
        assert ready == [f"{READY_PREFIX}{srv.base_url} (model {srv.model})"]
    finally:
        srv.kill()


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
