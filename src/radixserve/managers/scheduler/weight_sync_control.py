"""The scheduler's side of RL weight sync: the weights update group and the updates through it
or through shared memory (the model runner's side is ``model_executor/weight_sync.py``; the
server's, ``managers/tokenizer/weight_sync_client.py``).

Every rank of the replica handles each request (rank 0 forwards it to the others, as every
message): each joins the group as ``rank_offset + its rank``, receives every broadcast, and
writes its own shard. A refusal leaves the weights as they were and the cache untouched; a
successful update flushes the prefix cache when ``flush_cache`` asks (SGLang's default: cached
KV was computed with the old weights), else keeps it (a trainer sending its weights in several
buckets flushes with the last). The server side has drained the running requests first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixserve.managers.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    WeightsUpdateReqOutput,
)
from radixserve.model_executor.weight_sync import WeightsUpdateGroups, tensors_from_shared_memory

if TYPE_CHECKING:
    from radixserve.managers.scheduler.scheduler_control import ControlledScheduler

logger = logging.getLogger(__name__)


class WeightSyncControl:
    """Handlers of the four weight-sync requests."""

    def __init__(self, scheduler: ControlledScheduler) -> None:
        self.scheduler = scheduler
        runner = scheduler.tp_worker.model_runner
        world = runner.parallel.world
        self.groups = WeightsUpdateGroups(world.rank_in_group, world.size, runner.device)

    def handlers(self) -> list[tuple[type, Any]]:
        return [
            (InitWeightsUpdateGroupReqInput, self.init_group),
            (UpdateWeightsFromDistributedReqInput, self.update_from_distributed),
            (UpdateWeightsFromTensorReqInput, self.update_from_tensor),
            (DestroyWeightsUpdateGroupReqInput, self.destroy_group),
        ]

    @property
    def _runner(self) -> Any:
        return self.scheduler.tp_worker.model_runner

    def init_group(self, msg: InitWeightsUpdateGroupReqInput) -> WeightsUpdateReqOutput:
        backend = msg.backend or ("nccl" if self._runner.device.type == "cuda" else "gloo")
        try:
            self.groups.init_group(msg.master_address, msg.master_port, msg.rank_offset,
                                   msg.world_size, msg.group_name, backend)
        except (ValueError, RuntimeError) as e:
            logger.warning("init_weights_update_group refused: %s", e)
            return WeightsUpdateReqOutput(success=False, message=f"cannot join the group: {e}")
        return WeightsUpdateReqOutput(
            success=True, message=f"joined weights update group {msg.group_name!r} ({backend})")

    def destroy_group(self, msg: DestroyWeightsUpdateGroupReqInput) -> WeightsUpdateReqOutput:
        try:
            self.groups.destroy_group(msg.group_name)
        except ValueError as e:
            return WeightsUpdateReqOutput(success=False, message=str(e))
        return WeightsUpdateReqOutput(
            success=True, message=f"left weights update group {msg.group_name!r}")

    def update_from_distributed(
        self, msg: UpdateWeightsFromDistributedReqInput
    ) -> WeightsUpdateReqOutput:
        def receive() -> list[Any]:
            return self.groups.receive(msg.names, msg.dtypes, msg.shapes, msg.group_name)

        return self._update(receive, msg.flush_cache, "the trainer's broadcast")

    def update_from_tensor(self, msg: UpdateWeightsFromTensorReqInput) -> WeightsUpdateReqOutput:
        def receive() -> list[Any]:
            return tensors_from_shared_memory(msg.shm_name, msg.layout, self._runner.device)

        return self._update(receive, msg.flush_cache, "tensors in shared memory")

    def _update(self, receive: Any, flush_cache: bool, source: str) -> WeightsUpdateReqOutput:
        scheduler = self.scheduler
        scheduler.finish_step_in_flight()
        if not scheduler.is_idle():  # the server side drained first: a bug if not
            return WeightsUpdateReqOutput(success=False, message="requests are running")
        try:
            named_tensors = receive()
            self._runner.update_weights_from_tensors(named_tensors)
        except (ValueError, RuntimeError, OSError) as e:
            logger.warning("weight update from %s refused: %s", source, e)
            return WeightsUpdateReqOutput(success=False, message=f"weights not updated: {e}")
        if flush_cache:
            scheduler.flush()
        flushed = "; cache flushed" if flush_cache else ""
        return WeightsUpdateReqOutput(
            success=True, message=f"updated {len(named_tensors)} weights from {source}{flushed}")
