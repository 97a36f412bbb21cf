"""Run a function in several spawned ranks (one torch thread each) and collect what each returns.

The ranks meet at a free loopback port; ``target(rank, init_method, *args)`` joins the process
group itself (through ``init_parallel_state`` or ``torch.distributed``). Arguments and results
cross the process boundary as JSON. A rank that raises, exits or outlives the deadline fails the
call, and every rank is killed.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import time
import traceback
from multiprocessing.connection import wait
from typing import Any

import torch

from radixserve.managers.launcher import free_port


def _rank_main(target: str, rank: int, init_method: str, args_json: str, conn: Any) -> None:
    torch.set_num_threads(1)
    module_name, _, name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
        result = {"ok": fn(rank, init_method, *json.loads(args_json))}
    except BaseException:
        result = {"error": traceback.format_exc()}
    conn.send_bytes(json.dumps(result).encode())
    conn.close()


def run_ranks(target: str, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``target`` is ``"module:function"``; returns the ranks' results in rank order."""
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs, conns = [], []
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main, args=(target, rank, init_method, json.dumps(args), writer)
        )
        proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            pending = [c for r, c in enumerate(conns) if r not in results]
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            assert ready, f"ranks {sorted(set(range(world_size)) - set(results))} timed out"
            for conn in ready:
                rank = conns.index(conn)
                try:
                    reply = json.loads(conn.recv_bytes())
                except EOFError:
                    raise AssertionError(f"rank {rank} exited without a result") from None
                assert "error" not in reply, f"rank {rank} failed:\n{reply['error']}"
                results[rank] = reply["ok"]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]
