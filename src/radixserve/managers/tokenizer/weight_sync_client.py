"""The server process's side of RL weight sync (SGLang's API; the scheduler's side is
``managers/scheduler/weight_sync_control.py``, the transfer ``model_executor/weight_sync.py``).

Joining and leaving the weights update group are control calls; a join blocks the scheduler
until every member has joined, so before sending it the server checks what it can: the engine's
ranks fit in ``world_size``, and a torch.distributed store (the trainer's, rank 0) answers at
``master_address:master_port`` within ``MASTER_WAIT_S`` (the trainer starts it as it posts the
request). A bogus address or a port where no store answers is then a 400 within seconds, not a
scheduler stuck in a rendezvous. An update pauses admission and lets the requests in flight
finish first (``abort_all_requests`` aborts them instead), as ``update_weights_from_disk`` does,
then resumes. A refusal raises ``ValueError`` with the scheduler's reason (a 400 at the HTTP edge)
and the old weights keep serving.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
from typing import TYPE_CHECKING

import torch
from torch.distributed import TCPStore

from radixserve.managers import io_struct
from radixserve.model_config import resolve_device
from radixserve.model_executor.weight_sync import BACKENDS, tensors_to_shared_memory

if TYPE_CHECKING:
    from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager


MASTER_WAIT_S = 5.0  # how long a join waits for the trainer's store to listen


async def init_weights_update_group(
    tokenizer_manager: TokenizerManager, req: io_struct.InitWeightsUpdateGroupReqInput
) -> str:
    args = tokenizer_manager.server_args
    if args.dp_size > 1:
        raise ValueError("a weights update group with --dp-size > 1 is not supported: every "
                         "replica would take the same ranks")
    if req.backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {req.backend!r}")
    if req.backend == "nccl" and resolve_device(args.device).type != "cuda":
        raise ValueError("backend nccl needs CUDA; this engine runs on CPU: use gloo")
    ranks = args.tp_size * args.pp_size
    if req.rank_offset < 1 or req.rank_offset + ranks > req.world_size:
        raise ValueError(f"the engine's {ranks} rank(s) from rank_offset {req.rank_offset} do "
                         f"not fit in world_size {req.world_size} (rank 0 is the trainer)")
    await wait_for_master(req.master_address, req.master_port, MASTER_WAIT_S)
    return (await tokenizer_manager.control.call(req)).message


async def wait_for_master(address: str, port: int, wait_s: float) -> None:
    """Return once a torch.distributed store (the trainer's, rank 0) answers at
    ``address:port``; ``ValueError`` if the address does not resolve, is unspecified, or no
    store answers within ``wait_s`` (a probe client: it does not count as a member)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(address, port, type=socket.SOCK_STREAM), MASTER_WAIT_S)
        host = infos[0][4][0]
        unspecified = ipaddress.ip_address(host.split("%")[0]).is_unspecified
    except (OSError, UnicodeError, ValueError, TimeoutError) as e:
        raise ValueError(f"master_address {address!r} does not resolve: {e}") from e
    if unspecified:
        raise ValueError(f"master_address {address!r} is no host to connect to")

    def probe() -> None:
        TCPStore(host, port, None, False, datetime.timedelta(seconds=wait_s),
                 wait_for_workers=False)

    try:
        await asyncio.to_thread(probe)
    except (RuntimeError, OSError, ValueError) as e:
        raise ValueError(f"no torch.distributed store (the trainer's, rank 0) answers at "
                         f"{address}:{port} within {wait_s:g} s") from e


async def destroy_weights_update_group(
    tokenizer_manager: TokenizerManager, group_name: str
) -> str:
    req = io_struct.DestroyWeightsUpdateGroupReqInput(group_name=group_name)
    return (await tokenizer_manager.control.call(req)).message


async def update_weights_from_distributed(
    tokenizer_manager: TokenizerManager, req: io_struct.UpdateWeightsFromDistributedReqInput,
    abort_all_requests: bool = False,
) -> str:
    """Receive the named tensors the trainer broadcasts (it broadcasts while this waits)."""
    async with tokenizer_manager.weights_exclusive(abort_all_requests):
        return (await tokenizer_manager.control.call(req)).message


async def update_weights_from_tensor(
    tokenizer_manager: TokenizerManager, named_tensors: list[tuple[str, torch.Tensor]],
    flush_cache: bool = True, abort_all_requests: bool = False,
) -> str:
    """Hand ``named_tensors`` over in one shared-memory block (freed when this returns)."""
    block, layout = tensors_to_shared_memory(named_tensors)
    try:
        req = io_struct.UpdateWeightsFromTensorReqInput(
            shm_name=block.name, layout=layout, flush_cache=flush_cache)
        async with tokenizer_manager.weights_exclusive(abort_all_requests):
            return (await tokenizer_manager.control.call(req)).message
    finally:
        block.close()
        block.unlink()
