"""``--nnodes 2`` on loopback: machine 0 serves HTTP and rank 0, machine 1 runs rank 1.

The two "machines" are two ``radixserve serve`` processes meeting at ``--dist-init-addr``. Their
greedy output equals the one-process scheduler's; stopping machine 0 ends machine 1 too (its rank
loses its peer), both without orphans.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from radixserve.managers.launcher import free_port
from tests.distributed.conftest import GREEDY, SchedulerDriver
from tests.managers.conftest import make_prompts
from tests.server.conftest import KV_TOKENS, start_server

EXIT_DEADLINE_S = 60.0


def test_two_machines_on_loopback_serve_one_tp2_replica(llama_path: Path):
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--model-path", str(llama_path),
         "--dtype", "float32", "--device", "cpu", "--max-total-tokens", str(KV_TOKENS),
         "--log-level", "warning", "--node-rank", "1", *multi],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    node1_children: list[psutil.Process] = []
    try:
        node0 = start_server(llama_path, "--node-rank", "0", *multi)
        node1_children = psutil.Process(node1.pid).children(recursive=True)
        assert node1.stdout is not None and node1.stdout.readline().strip() == (
            "radixserve node 1 ready"
        )
        prompts = make_prompts(512, (5, 30), seed=3)
        with httpx.Client(base_url=node0.base_url, timeout=120) as http:
            r = http.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        driver = SchedulerDriver(llama_path)
        expected = driver.generate({f"p{i}": p for i, p in enumerate(prompts)})
        assert [o["output_ids"] for o in r.json()] == [expected["p0"].tokens,
                                                       expected["p1"].tokens]
        node0.check_clean_stop()
        deadline = time.monotonic() + EXIT_DEADLINE_S
        while node1.poll() is None:
            assert time.monotonic() < deadline, "machine 1 outlived machine 0"
            time.sleep(0.1)
        _, alive = psutil.wait_procs(node1_children, timeout=10)
        assert not alive, f"machine 1 left orphans: {alive}"
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        for child in node1_children:
            if child.is_running():
                child.kill()
