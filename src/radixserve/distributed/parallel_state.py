"""Which rank a scheduler process is, and the torch.distributed groups it talks over.

One replica (the whole server, or one data-parallel replica) runs ``tp_size * pp_size``
scheduler processes, one per rank, numbered stage by stage::

    rank = pp_rank * tp_size + tp_rank

    stage 0:  ranks 0 .. tp-1        rank 0 alone talks ZMQ (requests in, outputs out)
    stage 1:  ranks tp .. 2tp-1
    ...

Two kinds of group, each with a *device* group (NCCL on CUDA, gloo on CPU) for tensors and a
gloo group for the msgspec bytes that tell every rank what to schedule:

    tp      the ranks of one stage: all-reduce after row-parallel layers, all-gather of vocab
            shards, broadcast of requests and sampled tokens from the stage's first rank
    world   the whole replica: point-to-point between stages (rank (s, t) ↔ (s±1, t)) and the
            agreement on sizes every rank must share (the KV pool)

A replica of one rank initialises nothing: every collective of a group of one is a no-op, so the
single-process server runs exactly the code it ran before tensor parallelism existed.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radixserve.distributed import communication as comm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """The position of one scheduler process in its replica."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank out of range: {self}")

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> RankInfo:
        return cls(tp_size, pp_size, rank % tp_size, rank // tp_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_entry(self) -> bool:
        """Rank 0: receives the requests, sends the outputs."""
        return self.rank == 0

    def stage_rank(self, pp_rank: int) -> int:
        """The rank with this process's ``tp_rank`` in stage ``pp_rank`` (modulo the stages)."""
        return (pp_rank % self.pp_size) * self.tp_size + self.tp_rank

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this stage holds: an even split, the remainder on later stages."""
        if num_layers < self.pp_size:
            raise ValueError(
                f"pp_size {self.pp_size} is larger than the model's {num_layers} layers"
            )
        return range(
            self.pp_rank * num_layers // self.pp_size,
            (self.pp_rank + 1) * num_layers // self.pp_size,
        )


class RankGroup:
    """Ranks that compute together. Collectives on a group of one return at once."""

    def __init__(
        self,
        ranks: list[int],
        rank: int,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.ranks = ranks
        self.rank = rank  # global rank of this process
        self.size = len(ranks)
        self.rank_in_group = ranks.index(rank)
        self.device_group = device_group
        self.cpu_group = cpu_group

    @classmethod
    def single(cls, rank: int = 0) -> RankGroup:
        return cls([rank], rank)

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
                   ) -> torch.Tensor:
        """Sum (or ``op``) ``tensor`` in place over the group; returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along ``dim``, in rank order."""
        if self.size == 1:
            return tensor
        return comm.all_gather(tensor, self.size, dim, self.device_group)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The group's first rank's ``tensor``, copied into every rank's (same shape)."""
        if self.size > 1:
            dist.broadcast(tensor, src=self.first_rank, group=self.device_group)
        return tensor

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """The first rank's ``data`` on every rank (others pass None)."""
        if self.size == 1:
            assert data is not None
            return data
        return comm.broadcast_bytes(data, self.first_rank, self.cpu_group)


@dataclass
class ParallelState:
    """This process's rank and groups (one per scheduler process, passed down explicitly)."""

    info: RankInfo
    tp: RankGroup
    world: RankGroup
    p2p: comm.PointToPoint | None = None  # between pipeline stages (over the world groups)
    # --ep-size: MoE experts split over this many groups of the tp ranks (layers/fused_moe.py)
    ep_size: int = 1

    @classmethod
    def single(cls) -> ParallelState:
        return cls(RankInfo(), RankGroup.single(), RankGroup.single())

    @property
    def distributed(self) -> bool:
        return self.world.size > 1


def init_parallel_state(
    info: RankInfo, init_method: str, device: torch.device, timeout_s: float
) -> ParallelState:
    """Join the replica's process group and build its groups (every rank calls this, with the
    same ``init_method``: ``tcp://host:port`` of rank 0)."""
    if info.world_size == 1:
        return ParallelState.single()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=info.world_size,
        rank=info.rank,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )

    def groups(ranks: list[int]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        # Every rank creates every group, in the same order (torch.distributed requires it).
        # The gloo group for bytes is a group of its own even on CPU: under the overlap
        # schedule the scheduler thread broadcasts requests while the model thread reduces.
        return dist.new_group(ranks, backend=backend), dist.new_group(ranks, backend="gloo")

    world_ranks = list(range(info.world_size))
    world = RankGroup(world_ranks, info.rank, *groups(world_ranks))
    tp = None
    for stage in range(info.pp_size):
        ranks = [stage * info.tp_size + t for t in range(info.tp_size)]
        stage_groups = groups(ranks)
        if stage == info.pp_rank:
            tp = RankGroup(ranks, info.rank, *stage_groups)
    assert tp is not None
    logger.info(
        "rank %d of %d joined (tp %d/%d, pp %d/%d, %s)",
        info.rank, info.world_size, info.tp_rank, info.tp_size, info.pp_rank, info.pp_size,
        backend,
    )
    p2p = comm.PointToPoint(world.device_group, world.cpu_group) if info.pp_size > 1 else None
    return ParallelState(info, tp, world, p2p)


def destroy_parallel_state() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
