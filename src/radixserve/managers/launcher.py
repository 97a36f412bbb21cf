"""Process start-up, the ready/failure handshake and shutdown of a launch's child processes.

Parent side (the HTTP server's process, or an ``Engine``'s): ``start_subprocesses`` spawns
(multiprocessing ``spawn``) every child this machine runs (``child_processes``: one scheduler per
rank of each data-parallel replica, the detokenizer, the data-parallel controller), passes each
its arguments as JSON and the write end of a pipe, and returns once every child reported ready;
``watch_processes`` reports a child that dies later; ``terminate_processes`` stops them.

``_child_main`` is the spawn target; it imports the child's entry point there (the parent never
loads it). What the child itself calls to report and to end with its parent lives in
``managers/child_process.py``, which the entry points import instead of this module, so that
nothing imports back up into the launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection, wait
from typing import Any

from radixserve.managers.child_process import STOP_SIGNAL, report_failure
from radixserve.managers.ipc import PortArgs
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- parent side
_WATCH_POLL_S = 0.5
# How long the children may take to load the weights and report ready.
READY_TIMEOUT_S = 600.0


def server_args_to_json(server_args: ServerArgs) -> str:
    """What a child receives; it rebuilds with ``ServerArgs(**json.loads(text))``."""
    return json.dumps(dataclasses.asdict(server_args))


def port_args_to_json(port_args: PortArgs) -> str:
    """What a child receives; it rebuilds with ``PortArgs(**json.loads(text))``."""
    return json.dumps(dataclasses.asdict(port_args))


# ---------------------------------------------------------------------- child processes
def _child_main(name: str, server_args_json: str, port_args_json: str,
                ready_conn: Connection, child_args_json: str) -> None:
    """Spawn target: import the named entry point here, so the parent never loads it.

    Ctrl-C in a terminal, or SIGTERM to the process group, signals every process of the group;
    the children ignore both and are stopped by their parent (``STOP_SIGNAL``), which may still
    be draining requests.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore, which a child ending with os._exit
    # leaves to the resource tracker ("leaked semaphore" at every exit). No bar is shared
    # between processes: a thread lock serves.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        if name.startswith("scheduler"):
            from radixserve.managers.scheduler.scheduler_process import run_scheduler_process

            entry = partial(run_scheduler_process, rank_args_json=child_args_json)
        elif name == "detokenizer":
            from radixserve.managers.detokenizer_manager import run_detokenizer_process as entry
        else:
            from radixserve.managers.data_parallel_controller import (
                run_data_parallel_controller_process as entry,
            )
    except Exception as e:
        report_failure(ready_conn, e)
        raise
    entry(server_args_json, port_args_json, ready_conn)


def _read_ready(name: str, proc: mp.process.BaseProcess, conn: Connection) -> dict[str, Any]:
    """The child's ready message, or ``RuntimeError`` with its error or exit code."""
    try:
        info = json.loads(conn.recv_bytes()) if conn.poll() else None
    except EOFError:
        info = None
    if info is None:
        proc.join(1.0)
        raise RuntimeError(
            f"the {name} process exited (code {proc.exitcode}) before it was ready"
        )
    if info.get("status") != "ready":
        raise RuntimeError(f"the {name} process failed to start: {info.get('message')}")
    return info


def _wait_ready(
    children: dict[str, tuple[mp.process.BaseProcess, Connection]], timeout: float
) -> dict[str, dict[str, Any]]:
    """Wait for every child's ready message; the first failure or the timeout raises."""
    deadline = time.monotonic() + timeout
    pending = dict(children)
    infos = {}
    while pending:
        handles = [h for proc, conn in pending.values() for h in (conn, proc.sentinel)]
        ready = wait(handles, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError(
                f"timed out after {timeout:.0f}s waiting for the {', '.join(pending)} "
                f"process(es) to become ready"
            )
        for name, (proc, conn) in list(pending.items()):
            if conn in ready or proc.sentinel in ready:
                infos[name] = _read_ready(name, proc, conn)
                del pending[name]
    return infos


# A scheduler with a session store writes its sessions out before it exits on SIGTERM.
SESSION_STORE_STOP_TIMEOUT_S = 120.0


def stop_timeout(server_args: ServerArgs) -> float:
    """How long stopping the children may take before they are killed."""
    return SESSION_STORE_STOP_TIMEOUT_S if server_args.session_store is not None else 5.0


def stop_process(proc: mp.process.BaseProcess) -> None:
    """Ask a child to stop (``STOP_SIGNAL``: it ignores SIGTERM, see managers/child_process.py)."""
    if proc.is_alive() and proc.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, STOP_SIGNAL)


def terminate_processes(processes: list[mp.process.BaseProcess], timeout: float = 5.0) -> None:
    """``STOP_SIGNAL``, then SIGKILL whatever is still alive after ``timeout``; reap all."""
    for proc in processes:
        stop_process(proc)
    deadline = time.monotonic() + timeout
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def child_processes(server_args: ServerArgs) -> dict[str, str]:
    """Name → JSON arguments of every child this machine starts, schedulers first.

    One scheduler per rank this machine holds, for each data-parallel replica (the replicas'
    rank-0 processes are named ``scheduler`` / ``scheduler dpN``); machine 0 also runs the
    detokenizer and, with several replicas, the data-parallel controller. Each multi-rank replica
    meets at its own ``tcp://`` address: ``--dist-init-addr`` (port + replica index), or a free
    local port.
    """
    from radixserve.managers.scheduler.scheduler_process import RankArgs

    sa = server_args
    children: dict[str, str] = {}
    first = sa.node_rank * sa.ranks_per_node
    for dp_rank in range(sa.dp_size):
        init = None
        if sa.ranks_per_replica > 1:
            if sa.dist_init_addr is not None:
                host, _, port = sa.dist_init_addr.rpartition(":")
                init = f"tcp://{host}:{int(port) + dp_rank}"
            else:
                init = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(first, first + sa.ranks_per_node):
            name = "scheduler" + (f" dp{dp_rank}" if sa.dp_size > 1 else "")
            name += f" rank{rank}" if rank else ""
            args = RankArgs(rank=rank, dp_rank=dp_rank, dist_init_method=init)
            children[name] = json.dumps(dataclasses.asdict(args))
    if sa.node_rank == 0:
        children["detokenizer"] = "{}"
        if sa.dp_size > 1:
            children["data parallel controller"] = "{}"
    return children


def start_subprocesses(
    server_args: ServerArgs,
    port_args: PortArgs | None = None,
    ready_timeout: float | None = None,
) -> tuple[PortArgs, list[mp.process.BaseProcess], dict[str, Any]]:
    """Spawn this machine's children (``child_processes``); return once all are ready.

    Returns the endpoints (``port_args`` if given, else a fresh IPC directory), the processes
    (schedulers first) and the first replica's rank-0 ready message (``max_total_num_tokens``,
    ``max_running_requests``, ``context_len``, ``page_size``; none on a machine other than
    the first) with ``processes``: each child's name and pid. On any failure the children are
    killed, the IPC directory removed and ``RuntimeError`` raised. ``ready_timeout`` defaults
    to ``READY_TIMEOUT_S``.
    """
    timeout = READY_TIMEOUT_S if ready_timeout is None else ready_timeout
    port_args = port_args or PortArgs.create()
    ctx = mp.get_context("spawn")
    args_json = (server_args_to_json(server_args), port_args_to_json(port_args))
    children: dict[str, tuple[mp.process.BaseProcess, Connection]] = {}
    try:
        for name, child_args in child_processes(server_args).items():
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(name, *args_json, writer, child_args),
                name=f"radixserve-{name.replace(' ', '-')}",
                daemon=True,
            )
            proc.start()
            writer.close()
            children[name] = (proc, reader)
        infos = _wait_ready(children, timeout)
    except BaseException:
        terminate_processes([proc for proc, _ in children.values()], timeout=1.0)
        shutil.rmtree(port_args.directory, ignore_errors=True)
        raise
    finally:
        for _, conn in children.values():
            conn.close()
    entry = infos.get("scheduler", infos.get("scheduler dp0", {}))
    scheduler_info = {k: v for k, v in entry.items() if k != "status"}
    scheduler_info["processes"] = {name: proc.pid for name, (proc, _) in children.items()}
    return port_args, [proc for proc, _ in children.values()], scheduler_info


def watch_processes(
    processes: list[mp.process.BaseProcess], on_death: Callable[[str], None]
) -> threading.Event:
    """Call ``on_death(message)`` from a daemon thread if a child exits; set the event to stop."""
    stop = threading.Event()

    def watch() -> None:
        sentinels = {p.sentinel: p for p in processes}
        while not stop.is_set():
            dead = wait(list(sentinels), timeout=_WATCH_POLL_S)
            if dead and not stop.is_set():
                proc = sentinels[dead[0]]
                proc.join(1.0)
                on_death(f"the {proc.name} process exited unexpectedly (code {proc.exitcode})")
                return

    threading.Thread(target=watch, name="radixserve-watchdog", daemon=True).start()
    return stop
