"""A linear weight ready for its kernels, made once after loading by ``prepack_model``.

Loading fills each layer's plain ``[out, in]`` parameter (this rank's shard: a tensor-parallel
loader narrows the checkpoint tensor first). ``prepack_model`` then visits every ``Prepackable``
module once, and each builds the ``PackedWeight`` its forward multiplies with:

    PackedWeight.weight   the parameter as loaded, kept: a tied embedding reads it, a weight
                          reload writes it and packs again, tests compare with it
    + the layouts that this device's kernels read, and the choice among them by batch rows

    NativeWeight     torch's ``F.linear`` on the plain weight (any device, any dtype)
    CpuPackedWeight  bf16 on CPU: oneDNN's reordered copy (any batch), and radixserve's blocked
                     copy for small batches (``layers/cpu_kernels.py``) where memory allows

How a new linear type plugs in: subclass ``LinearBase`` (``layers/linear.py``) for a new split or
a new loader; its ``prepack`` is inherited and packs whatever shard the rank holds. A new weight
format (int8, a new device) adds a ``PackedWeight`` subclass and a ``LinearMethod`` that builds it;
layers and models do not change.
"""

from __future__ import annotations

import abc
import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_kernels import BlockedWeight
from radixserve.layers.custom_op import OpImpl

logger = logging.getLogger(__name__)

_GIB = 1 << 30


class PackedWeight(abc.ABC):
    """``weight`` (``[out, in]``, as loaded) plus the layouts a device's kernels read."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    @abc.abstractmethod
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for ``x`` ``[rows, in]``, in ``x``'s dtype."""

    def extra_bytes(self) -> int:
        """Memory the layouts take beyond ``weight``."""
        return 0


class NativeWeight(PackedWeight):
    """The plain weight through torch's ``F.linear``: the reference, and every device without
    kernels of its own."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class NotPacked(PackedWeight):
    """What a layer holds between construction and ``prepack_model``: calling it is a bug."""

    def __init__(self) -> None:
        super().__init__(torch.empty(0))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("weights not packed: call prepack_model() after loading the model")


def mkldnn_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, the weight reordered by ``mkldnn._reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")


class CpuPackedWeight(PackedWeight):
    """bf16 on CPU. oneDNN's reordered copy streams the weight about twice as fast as
    ``F.linear`` on the plain layout, at every batch size, with the same products; batches of up
    to ``blocked.max_rows`` rows take radixserve's small-batch kernels on their blocked copy,
    which stream it at memory speed."""

    def __init__(self, weight: torch.Tensor, small_batch_copy: bool) -> None:
        super().__init__(weight)
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.blocked = BlockedWeight.of(weight) if small_batch_copy else None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.blocked is not None and x.shape[0] <= self.blocked.max_rows:
            return self.blocked.linear(x, bias)
        return mkldnn_linear(x, self.onednn, bias)

    def extra_bytes(self) -> int:
        copies = [self.onednn] + ([self.blocked.packed] if self.blocked is not None else [])
        return sum(t.numel() * t.element_size() for t in copies)


def pack_float_weight(weight: torch.Tensor, impl: OpImpl, small_batch_copy: bool) -> PackedWeight:
    """The ``PackedWeight`` of an unquantised weight for a layer built with ``impl``."""
    if impl is OpImpl.CPU and weight.dtype == torch.bfloat16:
        return CpuPackedWeight(weight, small_batch_copy)
    return NativeWeight(weight)


class Prepackable(nn.Module):
    """A module whose weights are packed once after loading (linear layers, the LM head)."""

    @abc.abstractmethod
    def prepack(self, small_batch_copy: bool) -> PackedWeight:
        """Build and keep this module's ``PackedWeight`` from its loaded parameters; returns it.
        ``small_batch_copy``: memory allows layouts that only some batch sizes use."""


# The small-batch kernels keep another copy of every linear weight: only when that copy is
# small next to the machine's memory.
SMALL_BATCH_COPY_MAX_RAM_FRACTION = 0.1


def prepack_model(model: nn.Module, total_memory_bytes: int) -> None:
    """Pack every ``Prepackable`` module of a loaded ``model`` (once; again after a reload)."""
    modules = [m for m in model.modules() if isinstance(m, Prepackable)]
    weight_bytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    small_batch_copy = weight_bytes <= SMALL_BATCH_COPY_MAX_RAM_FRACTION * total_memory_bytes
    extra = sum(m.prepack(small_batch_copy).extra_bytes() for m in modules)
    if extra:
        logger.info("packed weights for this device's kernels: +%.2f GiB", extra / _GIB)
