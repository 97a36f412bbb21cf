"""The watchdog on a server of its own: a forward step that hangs past --watchdog-timeout dumps
every thread's stack, /health turns 503 (the scheduler cannot answer a liveness ping within
--health-timeout), and the server exits non-zero leaving no child process behind."""

from __future__ import annotations

import threading

import httpx
import psutil

from tests.server.conftest import start_server


def test_a_hung_step_dumps_stacks_turns_health_503_and_exits_nonzero(llama_path):
    srv = start_server(llama_path, "--watchdog-timeout", "8", "--health-timeout", "1",
                       env={"RADIXSERVE_TEST_INJECT_FAULTS": "1"})
    try:
        children = srv.children()
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            # slow_down cannot outlast the watchdog (it is bounded by --watchdog-timeout) ...
            r = c.post("/slow_down", json={"forward_sleep_time": 120})
            assert r.status_code == 400 and "--watchdog-timeout" in r.text, r.text

            def victim() -> None:  # ... so the hang is injected: this request's step hangs
                try:
                    with httpx.Client(base_url=srv.base_url, timeout=120) as v:
                        v.post("/generate", json={"text": "hang", "rid": "inject-hang-1",
                                                  "sampling_params": {"max_new_tokens": 2}})
                except httpx.HTTPError:
                    pass  # the server may go away under it

            threading.Thread(target=victim, daemon=True).start()
            statuses = []
            while True:  # until the step is stuck, then until the server is gone
                try:
                    statuses.append(c.get("/health").status_code)
                except httpx.HTTPError:
                    break
                if srv.proc.poll() is not None:
                    break
        assert 503 in statuses, statuses
        assert srv.proc.wait(120) != 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"orphans: {alive}"
        log = srv.stderr_tail(400)
        assert "watchdog" in log
        assert "Scheduler watchdog timeout: stacks of every thread follow" in log
        assert "most recent call first" in log  # faulthandler's stack dump
    finally:
        srv.kill()
