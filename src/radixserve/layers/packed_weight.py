"""A linear weight ready for its kernels, made once after loading by ``prepack_model``.

Loading fills each layer's plain ``[out, in]`` parameter (this rank's shard: a tensor-parallel
loader narrows the checkpoint tensor first). ``prepack_model`` then visits every ``Prepackable``
module once, and each builds the ``PackedWeight`` its forward multiplies with:

    PackedWeight.weight   the parameter as loaded, kept: a tied embedding reads it, a weight
                          reload writes it and packs again, tests compare with it
    + the layouts that this device's kernels read, and the choice among them by batch rows

    NativeWeight     torch's ``F.linear`` on the plain weight (any device, any dtype)
    CpuPackedWeight  bf16 or float32 on CPU: radixserve's blocked copy (``layers/cpu_kernels.py``)
                     for every batch size, where memory allows a second copy of the weights

How a new linear type plugs in: subclass ``LinearBase`` (``layers/linear.py``) for a new split or
a new loader; its ``prepack`` is inherited and packs whatever shard the rank holds. A new weight
format (int8, a new device) adds a ``PackedWeight`` subclass and a ``LinearMethod`` that builds it;
layers and models do not change.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_kernels, kernel_dispatch
from radixserve.layers.custom_op import OpImpl, select_impl

logger = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(frozen=True)
class PackOptions:
    """What ``prepack_model`` tells every module it packs."""

    room_for_copy: bool  # memory allows layouts that copy the weight
    batch_invariant: bool = False  # only kernels whose row results ignore the batch


class PackedWeight(abc.ABC):
    """``weight`` (``[out, in]``, as loaded) plus the layouts a device's kernels read."""

    # Whether a row's result is the same bits whatever the other rows of its batch: true of
    # radixserve's CPU kernels, not promised by torch's (oneDNN picks kernels by shape).
    batch_invariant = False

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


class MultiKernelWeight(PackedWeight):
    """A weight several kernels can multiply: ``candidates`` (names from
    ``layers/kernel_dispatch.py``), and ``table``, the one each row bucket runs: the static
    table until ``prepack_model`` autotunes it. ``linear`` looks the kernel up by the batch's
    rows in two tuples, no branching per call."""

    candidates: tuple[str, ...] = ()
    table: tuple[str, ...] = ()

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        # the dtype of the inputs it is timed with (prepack_model sets the model's)
        self.activation_dtype = weight.dtype if weight.is_floating_point() else torch.bfloat16

    @abc.abstractmethod
    def kind(self) -> str:
        """The weight format and activation dtype, part of the dispatch cache's key."""

    @abc.abstractmethod
    def kernels(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]:
        """Each candidate's ``linear``, by name."""

    @abc.abstractmethod
    def timing_proxy(self, max_out: int) -> MultiKernelWeight:
        """This weight, or one of the same kind on its first ``max_out`` output rows, to time."""

    def static(self) -> tuple[str, ...]:
        return kernel_dispatch.static_table(
            self.candidates, cpu_kernels.amx_available(), self.kind() == "bf16"
        )

    def restrict(self, batch_invariant: bool) -> None:
        """Keep only batch-invariant candidates (deterministic inference), back to the static
        table."""
        self.candidates = kernel_dispatch.allowed_candidates(self.candidates, batch_invariant)
        self.set_table(self.static())

    def set_table(self, table: Sequence[str]) -> None:
        kernels = self.kernels()
        self.table = tuple(table)
        self._by_bucket = tuple(kernels[name] for name in self.table)
        self.batch_invariant = all(
            kernel_dispatch.CANDIDATES[name].batch_invariant for name in set(self.table)
        )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = min(x.shape[0], kernel_dispatch.MAX_BUCKET_ROWS)
        return self._by_bucket[kernel_dispatch.BUCKET_OF_ROWS[rows]](x, bias)


class CpuPackedWeight(MultiKernelWeight):
    """bf16 or float32 on CPU: radixserve's blocked copy (``blocked``: decode batches stream it
    at memory speed where oneDNN reaches about half of it, and a row's result does not depend
    on its batch), on AMX CPUs the AMX kernels on the same copy for bf16 batches (``amx``: the
    small-batch kernel up to 32 rows, a tile GEMM above), and oneDNN's ``F.linear`` on the plain
    weight (``onednn``: on AMX CPUs many times faster than ``blocked`` from 64 rows up). Which
    runs per batch size is ``kernel_dispatch``'s choice; ``batch_invariant`` keeps only
    ``blocked``."""

    def __init__(self, weight: torch.Tensor, batch_invariant: bool = False) -> None:
        super().__init__(weight)
        self.n, k = weight.shape
        self.blocked = cpu_kernels.pack_linear_weight(weight)
        self.pad_k = self.blocked.shape[1] * self.blocked.shape[3] - k  # 1 for an odd bf16 K
        amx = (
            weight.dtype == torch.bfloat16
            and self.n % cpu_kernels.BLOCK_ROWS == 0
            and k % cpu_kernels.AMX_K_MULTIPLE == 0
            and cpu_kernels.amx_available()
        )
        names = (kernel_dispatch.BLOCKED, kernel_dispatch.AMX, kernel_dispatch.ONEDNN)
        self.candidates = tuple(n for n in names if amx or n != kernel_dispatch.AMX)
        self.restrict(batch_invariant)

    def kind(self) -> str:
        return "bf16" if self.weight.dtype == torch.bfloat16 else "fp32"

    def kernels(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]:
        return {
            kernel_dispatch.BLOCKED: self.linear_blocked,
            kernel_dispatch.AMX: self.linear_amx,
            kernel_dispatch.ONEDNN: self.linear_onednn,
        }

    def linear_blocked(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.pad_k:
            x = F.pad(x, (0, self.pad_k))
        elif x.stride(-1) != 1:
            x = x.contiguous()
        return cpu_kernels.linear(x, self.blocked, bias, self.n)

    def linear_amx(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_kernels.gemm_amx(x, self.blocked, bias)

    def linear_onednn(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def timing_proxy(self, max_out: int) -> CpuPackedWeight:
        if self.n <= max_out:
            return self
        proxy = CpuPackedWeight(self.weight[:max_out])
        proxy.candidates = self.candidates
        return proxy

    def extra_bytes(self) -> int:
        return self.blocked.numel() * self.blocked.element_size()


def pack_float_weight(weight: torch.Tensor, impl: OpImpl, options: PackOptions) -> PackedWeight:
    """The ``PackedWeight`` of an unquantised weight for a layer built with ``impl``."""
    if impl is OpImpl.CPU and weight.dtype in cpu_kernels.KERNEL_DTYPES and options.room_for_copy:
        return CpuPackedWeight(weight, options.batch_invariant)
    return NativeWeight(weight)


class Prepackable(nn.Module):
    """A module whose weights are packed once after loading (linear layers, the LM head).

    It picks its kernels when built, as a ``CustomOp`` does (``impl``, from the build context),
    and holds ``NotPacked`` until ``prepack_model`` calls ``prepack``, which keeps what the
    subclass's ``pack`` builds."""

    # model dtypes whose weights the CPU kernels pack, and the kernel they multiply with
    cpu_dtypes = cpu_kernels.KERNEL_DTYPES
    cpu_ops = ("linear",)

    def __init__(self) -> None:
        super().__init__()
        self.impl = select_impl(self.cpu_dtypes, self.cpu_ops)
        self.packed: PackedWeight = NotPacked()

    def prepack(self, options: PackOptions) -> PackedWeight:
        """Build and keep this module's ``PackedWeight`` from its loaded parameters; returns it."""
        self.packed = self.pack(options)
        return self.packed

    def pack(self, options: PackOptions) -> PackedWeight:
        """The ``PackedWeight`` of the loaded parameters, for the kernels of ``impl``."""
        raise NotImplementedError


# The kernels' layouts are a second copy of the weights: taken while the weights are at most
# this fraction of the machine's memory (so weights and copy stay under 80% of it).
PACKED_COPY_MAX_RAM_FRACTION = 0.4


def room_for_packed_copy(weight_bytes: int, total_memory_bytes: int) -> bool:
    """Whether weights of ``weight_bytes`` get the kernels' copies on this machine."""
    return weight_bytes <= PACKED_COPY_MAX_RAM_FRACTION * total_memory_bytes


def planned_copy_bytes(
    weight_bytes: int, device: torch.device, dtype: torch.dtype, total_memory_bytes: int
) -> int:
    """Memory ``prepack_model`` will take for the kernels' copies of a model whose weights are
    ``weight_bytes`` in ``dtype`` on ``device``, for planning before the model is built."""
    packs = (
        device.type == "cpu"
        and dtype in cpu_kernels.KERNEL_DTYPES
        and cpu_kernels.has_ops(*Prepackable.cpu_ops)
        and room_for_packed_copy(weight_bytes, total_memory_bytes)
    )
    return weight_bytes if packs else 0


def prepack_model(
    model: nn.Module,
    total_memory_bytes: int,
    batch_invariant: bool = False,
    cpu_kernel_autotune: str = "off",
) -> None:
    """Pack every ``Prepackable`` module of a loaded ``model`` (once; again after a reload).
    ``batch_invariant``: only kernels whose row results ignore the batch, or ValueError.
    ``cpu_kernel_autotune``: ``on`` times the kernels of each weight shape on this machine
    (cached, ``layers/kernel_dispatch.py``), ``off`` keeps the static table."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Prepackable)}
    weight_bytes = sum(
        p.numel() * p.element_size() for m in modules.values() for p in m.parameters()
    )
    options = PackOptions(room_for_packed_copy(weight_bytes, total_memory_bytes), batch_invariant)
    packed = {name: m.prepack(options) for name, m in modules.items()}
    multi = [p for p in packed.values() if isinstance(p, MultiKernelWeight)]
    activation_dtype = next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16
    )
    for p in multi:  # int8 weights learn the activations' dtype here
        p.activation_dtype = activation_dtype
        p.restrict(batch_invariant)
    if cpu_kernel_autotune == "on" and multi:
        cache = kernel_dispatch.machine_cache()
        kernel_dispatch.tune(multi, cache)
    elif multi:
        for key, table in kernel_dispatch.tables_by_shape(multi).items():
            logger.info("kernel dispatch %s (static): %s", key, kernel_dispatch.describe(table))
    variant = [name for name, p in packed.items() if not p.batch_invariant]
    if batch_invariant and variant:
        raise ValueError(
            f"no batch-invariant kernel for {', '.join(variant[:3])}: deterministic inference "
            "needs radixserve's CPU kernels (AVX-512, bf16 or float32) and memory for their "
            "weight copies"
        )
    extra = sum(p.extra_bytes() for p in packed.values())
    if extra:
        logger.info("packed weights for this device's kernels: +%.2f GiB", extra / _GIB)
