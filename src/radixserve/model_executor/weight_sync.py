"""Weights from an RL trainer, without a checkpoint on disk (SGLang's API, as verl, OpenRLHF and
slime call it).

Two ways in, one way to apply:

- ``WeightsUpdateGroups``: a torch.distributed group between the trainer (rank 0) and the
  engine's ranks (``rank_offset + tp_rank``), gloo here, nccl on CUDA. It is made as the
  trainers make theirs (``init_custom_process_group``: the store at ``tcp://address:port``,
  prefixed by that URL, a group that is not the process's default one), so a trainer's own copy
  of that helper meets it. ``receive`` takes one broadcast from rank 0 per (name, dtype, shape),
  in order, on every engine rank;
- shared memory (``Engine.update_weights_from_tensor`` on CPU): the tensors' bytes in one
  ``multiprocessing.shared_memory`` block that every rank of this machine maps
  (``tensors_from_shared_memory``).

``apply`` then writes a list of (checkpoint name, full tensor) into the served model: every tensor
is checked first (a name of the served checkpoint, the shape that checkpoint has, a floating
dtype), so a wrong one raises ``ValueError`` naming it and no weight has changed; then each goes
through its parameter's loader (which takes this rank's shard under tensor parallelism and
converts the dtype); the runner then packs the model's layers again for their kernels.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
from collections.abc import Iterable
from multiprocessing import shared_memory
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "float64": torch.float64,
}
DEFAULT_GROUP = "weight_update_group"
BACKENDS = ("gloo", "nccl")


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype by its name (``"bfloat16"`` or ``"torch.bfloat16"``); any torch dtype
    parses (a tensor of it can be received), only floating ones are loaded."""
    short = str(name).removeprefix("torch.")
    dtype = _DTYPES.get(short) or getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> Any:
    """A process group beside the process's default one (the engine's ranks have theirs),
    rendezvousing at ``init_method``; the helper RL trainers call on their side too."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    prefix_store = c10d.PrefixStore(init_method, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, prefix_store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightsUpdateGroups:
    """This rank's weight-update groups, by name."""

    def __init__(self, tp_rank: int, num_ranks: int, device: torch.device) -> None:
        self.tp_rank = tp_rank  # this rank in the replica, of num_ranks
        self.num_ranks = num_ranks
        self.device = device
        self.groups: dict[str, Any] = {}

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend nccl needs CUDA; this engine runs on CPU: use gloo")
        if group_name in self.groups:
            raise ValueError(f"a weights update group named {group_name!r} exists already")
        # checked alike on every rank, so that all refuse or none waits for the others
        if rank_offset < 1 or rank_offset + self.num_ranks > world_size:
            raise ValueError(f"the engine's {self.num_ranks} rank(s) from rank_offset "
                             f"{rank_offset} do not fit in world_size {world_size} (rank 0 is "
                             "the trainer)")
        rank = rank_offset + self.tp_rank
        self.groups[group_name] = init_custom_process_group(
            backend, f"tcp://{master_address}:{master_port}", world_size, rank, group_name
        )
        logger.info("joined weights update group %r as rank %d of %d", group_name, rank,
                    world_size)

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weights update group named {group_name!r}")
        with contextlib.suppress(Exception):  # the trainer may have gone first
            torch.distributed.destroy_process_group(group)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str) -> list[tuple[str, torch.Tensor]]:
        """One tensor per name, broadcast by rank 0 of ``group_name`` in this order."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, "
                             f"{len(dtypes)}, {len(shapes)})")
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weights update group named {group_name!r}: "
                             "init_weights_update_group first")
        parsed = [parse_dtype(d) for d in dtypes]
        received = []
        for name, dtype, shape in zip(names, parsed, shapes, strict=True):
            tensor = torch.empty(list(shape), dtype=dtype, device=self.device)
            torch.distributed.broadcast(tensor, src=0, group=group)
            received.append((name, tensor))
        return received


def tensors_to_shared_memory(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[shared_memory.SharedMemory, list[tuple[str, str, list[int], int]]]:
    """Copy the tensors into one new shared-memory block; returns it (the caller unlinks it)
    and each tensor's (name, dtype, shape, byte offset)."""
    items = [(name, t.detach().to("cpu").contiguous()) for name, t in named_tensors]
    size = sum(t.numel() * t.element_size() for _, t in items)
    block = shared_memory.SharedMemory(create=True, size=max(size, 1))
    layout, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        view = torch.frombuffer(block.buf, dtype=torch.uint8, count=nbytes, offset=offset)
        view.copy_(t.view(-1).view(torch.uint8))
        del view
        layout.append((name, dtype_name(t.dtype), list(t.shape), offset))
        offset += nbytes
    return block, layout


def tensors_from_shared_memory(
    block_name: str, layout: list[tuple[str, str, list[int], int]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a block ``tensors_to_shared_memory`` wrote, copied out onto ``device``."""
    block = shared_memory.SharedMemory(name=block_name)
    try:
        out = []
        for name, dtype, shape, offset in layout:
            torch_dtype = parse_dtype(dtype)
            count = math.prod(shape) * torch_dtype.itemsize
            raw = torch.frombuffer(block.buf, dtype=torch.uint8, count=count, offset=offset)
            out.append((name, raw.clone().view(torch_dtype).view(shape).to(device)))
            del raw
        return out
    finally:
        block.close()


def checkpoint_shapes(model_path: str) -> dict[str, list[int]]:
    """Each tensor's shape in the served safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    from radixserve.gguf_file import find_gguf
    from radixserve.model_executor.checkpoint_files import checkpoint_files

    if find_gguf(model_path) is not None:
        raise ValueError("weight sync needs a safetensors checkpoint; this model is a GGUF file")
    shapes = {}
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


def check_named_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], checkpoint_shapes: dict[str, list[int]],
) -> None:
    """``ValueError`` naming the first tensor the served model cannot take."""
    from radixserve.model_executor.kv_scales import is_kv_scale_name

    for name, tensor in named_tensors:
        if is_kv_scale_name(name):
            raise ValueError(f"{name!r} is a KV-cache scale: the KV cache keeps the served "
                             "checkpoint's while the server runs")
        if name not in checkpoint_shapes:
            raise ValueError(f"{name!r} is not a weight of the served checkpoint")
        if list(tensor.shape) != list(checkpoint_shapes[name]):
            raise ValueError(f"{name!r} has shape {list(tensor.shape)}; the served "
                             f"checkpoint's is {list(checkpoint_shapes[name])}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name!r} has dtype {dtype_name(tensor.dtype)}: weights are "
                             "floating point")


def load_named_tensors(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
    """Write each checked tensor through its parameter's loader; returns the modules touched."""
    from radixserve.layers.linear_method import load_into_parameter
    from radixserve.model_executor.model_loader import route_checkpoint_name

    params = dict(model.named_parameters())
    holds_weight = getattr(model, "holds_weight", None)  # pipeline stages: a part of the model
    routed = []
    for name, tensor in named_tensors:
        if holds_weight is not None and not holds_weight(name):
            continue
        target, shard_id = route_checkpoint_name(name, model.packed_modules_mapping)
        if target not in params:  # checked for all before any is written
            raise ValueError(f"the served model has no parameter for {name!r}")
        routed.append((target, shard_id, tensor))
    touched = set()
    for target, shard_id, tensor in routed:
        load_into_parameter(params[target], tensor, shard_id)
        touched.add(target.rsplit(".", 1)[0])
    return touched
