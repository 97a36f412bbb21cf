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

Which parameters a layer has is its ``LinearMethod``'s business: unquantised layers have one
``weight`` ``[out, in]``; a pre-quantised checkpoint's layers have its packed int8 tensors and
scales (``layers/quantization``). Every parameter records which of its dimensions follow the
layer's output and input (``output_dim``, ``input_dim``: None when the parameter is whole on
every rank), and the layer's loader narrows the checkpoint tensor along them.

After loading, ``prepack_model`` (``layers/packed_weight.py``) calls every layer's ``prepack``
once: its method builds the ``PackedWeight`` of this rank's loaded shard for the kernels of the
device the model was built for, and ``forward`` multiplies with it.

How a new linear type plugs in: subclass ``LinearBase`` for another split, give it
``shard_sizes`` (the rank's part of the layer's sizes) and a ``weight_loader`` that narrows each
parameter to the rank's shard along ``output_dim`` / ``input_dim`` (and places a fused layer's
shards); the constructor's keywords (``LinearOptions``), parameters, packing and forward are
inherited, whatever the quantisation. A new weight format adds a ``LinearMethod``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, Unpack

import torch
from torch import nn

from radixserve.distributed import RankGroup
from radixserve.layers.linear_method import (
    UnquantizedLinearMethod,
    WeightSource,
    default_weight_loader,
    sharded_parameter,
)
from radixserve.layers.packed_weight import PackedWeight, PackOptions, Prepackable

if TYPE_CHECKING:
    from radixserve.layers.quantization.base import QuantizationConfig


class LayerOptions(TypedDict, total=False):
    """The keywords every layer with a sharded, packed weight takes (the linear layers and the
    LM head), the same for all layers of a model; ``layer_options`` reads them."""

    quant_config: QuantizationConfig | None  # the checkpoint's quantisation; None (default): none
    tp: RankGroup | None  # the tensor-parallel group; None (default): one rank, whole weights


def layer_options(options: LayerOptions) -> tuple[QuantizationConfig | None, RankGroup]:
    """``options``' quantisation and tensor-parallel group; a keyword that ``LayerOptions``
    does not name is a TypeError, as it would be in an explicit signature."""
    unknown = options.keys() - LayerOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
    return options.get("quant_config"), options.get("tp") or RankGroup.single()


class LinearOptions(LayerOptions, total=False):
    """A linear layer's keywords: ``LayerOptions`` and whether it adds a bias."""

    bias: bool  # default False


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
    """``y = x @ weight.T (+ bias)`` with a per-rank weight of shape ``[out, in]``.

    Built from the whole layer's sizes; ``shard_sizes`` says which part of them this rank holds,
    so a subclass for another split needs no constructor of its own."""

    def __init__(
        self, input_size: int, output_size: int, **options: Unpack[LinearOptions]
    ) -> None:
        super().__init__()
        bias = options.pop("bias", False)
        quant_config, self.tp = layer_options(options)
        self.tp_rank = self.tp.rank_in_group
        self.tp_size = self.tp.size
        self.input_size, self.output_size = self.shard_sizes(input_size, output_size)  # rank's
        self.method = (
            quant_config.linear_method() if quant_config is not None else UnquantizedLinearMethod()
        )
        self.method.create_weights(self, self.input_size, self.output_size)
        if bias:
            self.bias = sharded_parameter(
                torch.empty(self.output_size), self.weight_loader, output_dim=0, input_dim=None
            )
        else:
            self.register_parameter("bias", None)

    def shard_sizes(self, input_size: int, output_size: int) -> tuple[int, int]:
        """This rank's ``(input, output)`` sizes of the whole layer's (``tp_size`` is known when
        it is called); each subclass knows its split."""
        raise NotImplementedError

    def pack(self, options: PackOptions) -> PackedWeight:
        return self.method.pack(self, options)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        """Copy this rank's slice of a checkpoint tensor; each subclass knows its split."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank holds rows ``[rank*n, (rank+1)*n)``."""

    def shard_sizes(self, input_size: int, output_size: int) -> tuple[int, int]:
        return input_size, divide(output_size, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (``gate_up_proj``: gate, up).

    Shard ``i`` of the checkpoint fills rows ``sum(output_sizes[:i]) / tp_size`` onwards.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], **options: Unpack[LinearOptions]
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), **options)

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
        **options: Unpack[LinearOptions],
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, **options)

    def shard_sizes(self, input_size: int, output_size: int) -> tuple[int, int]:
        """The rank's share of the query heads and the KV heads they read (see
        ``kv_heads_per_rank``), kept as ``num_heads``, ``num_kv_heads`` and ``kv_replicas``: with
        replicated KV heads the rank's rows are not ``output_size / tp_size``."""
        self.num_heads = divide(self.total_num_heads, self.tp_size)
        self.num_kv_heads = kv_heads_per_rank(self.total_num_kv_heads, self.tp_size)
        self.kv_replicas = max(1, self.tp_size // self.total_num_kv_heads)
        return input_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

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

    def shard_sizes(self, input_size: int, output_size: int) -> tuple[int, int]:
        return divide(input_size, self.tp_size), output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        dim = param.input_dim
        if dim is None:  # the bias (and a per-channel scale) is whole on every rank
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[dim]
        default_weight_loader(param, loaded_weight.narrow(dim, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.packed.linear(x, self.bias)
        out = self.tp.all_reduce(self.packed.linear(x, None))
        return out if self.bias is None else out + self.bias
