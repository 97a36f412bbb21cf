"""Ranks and their communication: ``torch.distributed`` groups, collectives, point to point.

Callers use ``init_parallel_state`` once per scheduler process and pass the ``ParallelState`` it
returns down to the layers that communicate; nothing here is global.
"""

from radixserve.distributed.communication import PointToPoint
from radixserve.distributed.parallel_state import (
    ParallelState,
    RankGroup,
    RankInfo,
    destroy_parallel_state,
    init_parallel_state,
)

__all__ = [
    "ParallelState",
    "PointToPoint",
    "RankGroup",
    "RankInfo",
    "destroy_parallel_state",
    "init_parallel_state",
]
