"""The server process's side of RL weight sync (SGLang's API; the scheduler's side is
``managers/scheduler/weight_sync_control.py``, the transfer ``model_executor/weight_sync.py``).

Joining and leaving the weights update group are plain control calls (they block the scheduler
until the trainer's side joins too). An update pauses admission and lets the requests in flight
finish first (``abort_all_requests`` aborts them instead), as ``update_weights_from_disk`` does,
then resumes. A refusal raises ``ValueError`` with the scheduler's reason (a 400 at the HTTP edge)
and the old weights keep serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.managers import io_struct
from radixserve.model_executor.weight_sync import tensors_to_shared_memory

if TYPE_CHECKING:
    from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager


async def init_weights_update_group(
    tokenizer_manager: TokenizerManager, req: io_struct.InitWeightsUpdateGroupReqInput
) -> str:
    if tokenizer_manager.server_args.dp_size > 1:
        raise ValueError("a weights update group with --dp-size > 1 is not supported: every "
                         "replica would take the same ranks")
    return (await tokenizer_manager.control.call(req)).message


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
