"""The scheduler process: one per rank of each replica (see ``launcher.child_processes``).

``run_scheduler_process`` joins the replica's process group, wires rank 0 to ZMQ (the others
send nothing: rank 0 sends the same outputs), builds the ``Scheduler`` and runs the loop
``build_scheduler`` chose for it (normal, overlap or pipeline: ``scheduler_loop.py``).
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import zmq

from radixserve.distributed import ParallelState, RankInfo, init_parallel_state
from radixserve.managers import child_process, ipc
from radixserve.managers.scheduler.request_receiver import RequestReceiver
from radixserve.managers.scheduler.scheduler_builder import build_scheduler
from radixserve.model_config import resolve_device
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankArgs:
    """What tells one scheduler process of a launch from the others (passed as JSON)."""

    rank: int = 0  # in its replica: pp_rank * tp_size + tp_rank
    dp_rank: int = 0
    dist_init_method: str | None = None  # tcp://HOST:PORT of the replica's rank 0


def scheduler_threads(processes_per_node: int = 1) -> int:
    """Torch threads of the scheduler: ``OMP_NUM_THREADS`` when set, else this process's share
    of the allowed CPUs (the model forward is the only CPU-heavy work of the process, and the
    ranks and replicas of one machine split its cores)."""
    allowed = max(1, len(os.sched_getaffinity(0)) // processes_per_node)
    value = os.environ.get("OMP_NUM_THREADS", "")
    if not value:
        return allowed
    if not value.isdigit() or int(value) < 1:
        logger.warning("ignoring OMP_NUM_THREADS=%r: not a positive integer", value)
        return allowed
    return int(value)


def rank_device(server_args: ServerArgs, info: RankInfo, dp_rank: int) -> torch.device:
    """The device of one rank: on CUDA one GPU per rank of the machine, in launch order."""
    device = resolve_device(server_args.device)
    if device.type != "cuda":
        return device
    return torch.device(
        "cuda", dp_rank * server_args.ranks_per_node + info.rank % server_args.ranks_per_node
    )


def _discard(msg: Any) -> None:
    """Outputs of a rank other than 0: rank 0 sends the same ones."""


def run_scheduler_process(
    server_args_json: str, port_args_json: str, ready_conn: Any, rank_args_json: str = "{}"
) -> None:
    """Entry point of the spawned scheduler process (arguments arrive as JSON, never pickled)."""
    server_args = ServerArgs(**json.loads(server_args_json))
    rank_args = RankArgs(**json.loads(rank_args_json))
    info = RankInfo.of_rank(rank_args.rank, server_args.tp_size, server_args.pp_size)
    name = "scheduler"
    if server_args.dp_size > 1:
        name += f" dp{rank_args.dp_rank}"
    if info.world_size > 1:
        name += f" rank{info.rank}"
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    child_process.install_exit_handlers()
    torch.set_num_threads(scheduler_threads(server_args.processes_per_node))
    random.seed(server_args.random_seed)
    torch.manual_seed(server_args.random_seed)
    ctx = zmq.Context()
    try:
        try:
            device = rank_device(server_args, info, rank_args.dp_rank)
            parallel = (
                init_parallel_state(
                    info, rank_args.dist_init_method, device, server_args.dist_timeout
                )
                if rank_args.dist_init_method is not None
                else ParallelState.single()
            )
            port_args = ipc.PortArgs(**json.loads(port_args_json))
            recv, send_load = None, None
            to_detokenizer: Callable[[Any], None] = _discard
            to_tokenizer: Callable[[Any], None] = _discard
            if info.is_entry:
                recv = ipc.pull_socket(
                    ctx, port_args.replica_input(rank_args.dp_rank, server_args.dp_size)
                )
                to_detokenizer = partial(
                    ipc.send, ipc.push_socket(ctx, port_args.detokenizer_input)
                )
                to_tokenizer = partial(ipc.send, ipc.push_socket(ctx, port_args.tokenizer_input))
                if server_args.dp_size > 1:
                    send_load = partial(ipc.send, ipc.push_socket(ctx, port_args.scheduler_input))
            scheduler = build_scheduler(
                server_args, to_detokenizer, to_tokenizer, parallel=parallel, device=device,
                dp_rank=rank_args.dp_rank, send_load=send_load,
            )
        except Exception as e:
            logger.exception("scheduler failed to start")
            child_process.report_failure(ready_conn, e)
            raise SystemExit(1) from e
        if server_args.session_store is not None:
            # Sessions are written to the store before the process ends (one rank only:
            # ServerArgs refuses a store with parallel ranks).
            child_process.on_sigterm(scheduler.request_stop)
        child_process.report_ready(ready_conn, scheduler.ready_info())
        logger.info("scheduler ready: %s", scheduler.ready_info())
        receiver = RequestReceiver(parallel, recv, scheduler.sessions.expired_ids)
        scheduler.receiver = receiver
        # The loop build_scheduler chose (normal, overlap or pipeline) runs until a stop, which
        # persisted the sessions (without a session store it never stops).
        scheduler.loop.run_forever(receiver)
        os._exit(0)
    finally:
        ctx.destroy(linger=0)
