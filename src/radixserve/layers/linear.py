"""Tensor-parallel-aware linear layers whose parameters know how to load their own shard.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])``. A fused layer
(``qkv_proj``, ``gate_up_proj``) is loaded from several checkpoint tensors, one ``shard_id`` each,
and places each at its offset; every layer narrows the checkpoint tensor to this rank's slice.
Column-parallel layers split the output dimension, row-parallel ones the input dimension and sum
their partial outputs over the tensor-parallel group.

``loaded_weight`` is a ``WeightSource``: a tensor, or a lazy view of a checkpoint tensor
(``model_loader.SafetensorsSlice``) whose ``narrow`` only records the slice; the loader reads
from disk when it copies (``materialize``), so a rank reads its shard and never the whole tensor.

Grouped-query attention with fewer KV heads than ranks (``tp_size > num_kv_heads``) gives every
rank one KV head, each head replicated on ``tp_size / num_kv_heads`` consecutive ranks (the
ranks whose query heads read it), as SGLang does.

After loading, ``prepack_model`` (``layers/packed_weight.py``) calls every layer's ``prepack``
once: it builds the ``PackedWeight`` of this rank's loaded shard for the kernels of the device
the model was built for, and ``forward`` multiplies with it. A new linear type (another split,
another loader) subclasses ``LinearBase``, creates its parameters there with ``weight_loader``s
that narrow the checkpoint tensor to the rank's shard, and inherits packing and forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from radixserve.distributed import RankGroup
from radixserve.layers.custom_op import select_impl
from radixserve.layers.packed_weight import NotPacked, PackedWeight, Prepackable, pack_float_weight


class LazyWeight(Protocol):
    """A checkpoint tensor not read yet: ``narrow`` narrows what ``load`` will read."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight: ...

    def load(self) -> torch.Tensor: ...


WeightSource = torch.Tensor | LazyWeight


def materialize(source: WeightSource) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source.load()


def default_weight_loader(param: torch.Tensor, loaded_weight: WeightSource) -> None:
    """Copy ``loaded_weight`` into ``param`` (or a view of it), converting dtype and device."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
            f"{tuple(loaded_weight.shape)}"
        )
    param.data.copy_(materialize(loaded_weight))


def divide(numerator: int, denominator: int, what: str = "tp_size") -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {what} {denominator}")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: a share of them, or one replicated head when there are fewer
    heads than ranks."""
    if tp_size >= total_num_kv_heads:
        divide(tp_size, total_num_kv_heads, "num_key_value_heads")
        return 1
    return divide(total_num_kv_heads, tp_size)


class LinearBase(Prepackable):
    """``y = x @ weight.T (+ bias)`` with a per-rank weight of shape ``[out, in]``."""

    # model dtypes whose weights the CPU kernels pack (layers/packed_weight.py)
    cpu_dtypes = (torch.bfloat16,)

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: RankGroup | None
    ) -> None:
        super().__init__()
        self.tp = tp or RankGroup.single()
        self.tp_rank = self.tp.rank_in_group
        self.tp_size = self.tp.size
        self.impl = select_impl(self.cpu_dtypes)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed: PackedWeight = NotPacked()

    def prepack(self, small_batch_copy: bool) -> PackedWeight:
        self.packed = pack_float_weight(self.weight.detach(), self.impl, small_batch_copy)
        return self.packed

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        """Copy this rank's slice of a checkpoint tensor; each subclass knows its split."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank holds rows ``[rank*n, (rank+1)*n)``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: RankGroup | None = None,
    ) -> None:
        size = (tp or RankGroup.single()).size
        super().__init__(input_size, divide(output_size, size), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (``gate_up_proj``: gate, up).

    Shard ``i`` of the checkpoint fills rows ``sum(output_sizes[:i]) / tp_size`` onwards.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: RankGroup | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """``(offset, size)`` of shard ``shard_id``'s rows on this rank."""
        size = divide(self.output_sizes[shard_id], self.tp_size)
        return divide(sum(self.output_sizes[:shard_id]), self.tp_size), size

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: int
    ) -> None:
        offset, size = self.shard_range(shard_id)
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(LinearBase):
    """Fused q, k and v projections; each rank holds its query heads then its KV heads.

    With ``tp_size >= total_num_kv_heads`` each rank holds one KV head: head
    ``tp_rank // kv_replicas``, the one its query heads attend with.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp: RankGroup | None = None,
    ) -> None:
        tp_size = (tp or RankGroup.single()).size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp_size)
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        """``(offset, size)`` of shard ``"q"``, ``"k"`` or ``"v"``'s rows on this rank."""
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: str
    ) -> None:
        offset, size = self.shard_range(shard_id)
        # the rank's query heads, or the KV heads they read (replicated when tp > kv heads)
        shard = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        part = loaded_weight.narrow(0, shard * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the TP group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: RankGroup | None = None,
    ) -> None:
        size = (tp or RankGroup.single()).size
        super().__init__(divide(input_size, size), output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.packed.linear(x, self.bias)
        out = self.tp.all_reduce(self.packed.linear(x, None))
        return out if self.bias is None else out + self.bias
