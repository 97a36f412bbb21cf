"""Tensor-parallel-aware linear layers whose parameters know how to load their own shard.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])``. A fused layer
(``qkv_proj``, ``gate_up_proj``) is loaded from several checkpoint tensors, one ``shard_id`` each,
and places each at its offset; every layer narrows the full checkpoint tensor to this rank's
slice. Column-parallel layers split the output dimension, row-parallel ones the input dimension.
Only ``tp_size == 1`` runs today, but the shapes and loaders are already per rank.

Which parameters a layer has is its ``LinearMethod``'s business: unquantised layers have one
``weight`` ``[out, in]``; a pre-quantised checkpoint's layers have its packed int8 tensors and
scales (``layers/quantization``). Every parameter records which of its dimensions follow the
layer's output and input (``output_dim``, ``input_dim``: None when the parameter is whole on
every rank), and the layer's loader narrows the checkpoint tensor along them.

After loading, ``prepack_model`` (``layers/packed_weight.py``) calls every layer's ``prepack``
once: its method builds the ``PackedWeight`` of this rank's loaded shard for the kernels of the
device the model was built for, and ``forward`` multiplies with it.

How a new linear type plugs in: subclass ``LinearBase`` for another split and give it a
``weight_loader`` that narrows each parameter to the rank's shard along ``output_dim`` /
``input_dim`` (and places a fused layer's shards); parameters, packing and forward are
inherited, whatever the quantisation. A new weight format adds a ``LinearMethod``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import select_impl
from radixserve.layers.packed_weight import (
    NotPacked,
    PackedWeight,
    PackOptions,
    Prepackable,
    pack_float_weight,
)

if TYPE_CHECKING:
    from radixserve.layers.quantization import QuantizationConfig


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy ``loaded_weight`` into ``param`` (or a view of it), converting dtype and device."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
            f"{tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def sharded_parameter(
    data: torch.Tensor, loader: object, output_dim: int | None, input_dim: int | None
) -> nn.Parameter:
    """A frozen parameter with its loader and the dimensions that tensor parallelism splits."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    param.output_dim = output_dim
    param.input_dim = input_dim
    return param


class LinearMethod(abc.ABC):
    """How a linear layer holds its weight: the parameters the checkpoint fills (this rank's
    shard) and the ``PackedWeight`` built from them once they are loaded."""

    @abc.abstractmethod
    def create_weights(self, layer: LinearBase, input_size: int, output_size: int) -> None:
        """Register ``layer``'s weight parameters for an ``[output_size, input_size]`` shard,
        each with ``layer.weight_loader`` (``sharded_parameter``)."""

    @abc.abstractmethod
    def pack(self, layer: LinearBase, options: PackOptions) -> PackedWeight:
        """The ``PackedWeight`` of the loaded parameters, for ``layer.impl``."""


class UnquantizedLinearMethod(LinearMethod):
    """One ``weight`` ``[out, in]`` in the model's dtype."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int) -> None:
        weight = torch.empty(output_size, input_size)
        layer.weight = sharded_parameter(weight, layer.weight_loader, output_dim=0, input_dim=1)

    def pack(self, layer: LinearBase, options: PackOptions) -> PackedWeight:
        return pack_float_weight(layer.weight.detach(), layer.impl, options)


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


class LinearBase(Prepackable):
    """``y = x @ weight.T (+ bias)`` with a per-rank weight of shape ``[out, in]``."""

    # model dtypes whose weights the CPU kernels pack (layers/packed_weight.py)
    cpu_dtypes = cpu_kernels.KERNEL_DTYPES

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.input_size = input_size  # this rank's
        self.output_size = output_size
        self.impl = select_impl(self.cpu_dtypes)
        self.method = (
            quant_config.linear_method() if quant_config is not None else UnquantizedLinearMethod()
        )
        self.method.create_weights(self, input_size, output_size)
        if bias:
            self.bias = sharded_parameter(
                torch.empty(output_size), self.weight_loader, output_dim=0, input_dim=None
            )
        else:
            self.register_parameter("bias", None)
        self.packed: PackedWeight = NotPacked()

    def prepack(self, options: PackOptions) -> PackedWeight:
        self.packed = self.method.pack(self, options)
        return self.packed

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
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
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            input_size, _divide(output_size, tp_size), bias, tp_rank, tp_size, quant_config
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
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
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, quant_config)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """``(offset, size)`` of shard ``shard_id``'s rows on this rank."""
        size = _divide(self.output_sizes[shard_id], self.tp_size)
        return _divide(sum(self.output_sizes[:shard_id]), self.tp_size), size

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int
    ) -> None:
        offset, size = self.shard_range(shard_id)
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections; each rank holds its query heads then its KV heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size)
        self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size, quant_config)

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
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str
    ) -> None:
        offset, size = self.shard_range(shard_id)
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the TP group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            _divide(input_size, tp_size), output_size, bias, tp_rank, tp_size, quant_config
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        dim = param.input_dim
        if dim is None:  # the bias (and a per-channel scale) is whole on every rank
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[dim]
        default_weight_loader(param, loaded_weight.narrow(dim, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.packed.linear(x, self.bias)
        out = self.packed.linear(x, None)
        torch.distributed.all_reduce(out)
        return out if self.bias is None else out + self.bias
