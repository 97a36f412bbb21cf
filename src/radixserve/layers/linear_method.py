"""The contract between a linear layer and the way it holds its weight (``LinearMethod``),
and what loading a weight needs (``WeightSource``, ``sharded_parameter``).

It sits below both its users: the layers (``linear.py``, ``vocab_embedding.py``) and the
quantisation schemes (``layers/quantization``), whose methods register a layer's parameters and
pack them; neither imports the other to reach this contract. A method sees its layer through
``LinearLayer``: the few attributes every linear layer has, plus the parameters the method
itself registers on it.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from radixserve.layers.packed_weight import PackedWeight, PackOptions, pack_float_weight


class LazyWeight(Protocol):
    """A checkpoint tensor not read yet: ``narrow`` narrows what ``load`` will read."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight: ...

    def load(self) -> torch.Tensor: ...


WeightSource = torch.Tensor | LazyWeight


class RangedLazyWeight(abc.ABC):
    """A ``LazyWeight`` that keeps its narrowing as one ``(start, stop)`` range per dimension.

    The checkpoint readers (safetensors slices, GGUF tensors) differ only in how ``load`` reads
    the ranges, so the range bookkeeping and its bounds check live here once. ``name`` (None:
    unnamed) is added to the out-of-range error.
    """

    name: str | None = None
    _ranges: list[tuple[int, int]]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> RangedLazyWeight:
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            of_name = f" of {self.name}" if self.name is not None else ""
            raise ValueError(
                f"slice [{start}, {start + length}) out of range for dimension {dim} of size "
                f"{hi - lo}{of_name}"
            )
        out = copy.copy(self)
        out._ranges = list(self._ranges)
        out._ranges[dim] = (lo + start, lo + start + length)
        return out

    @abc.abstractmethod
    def load(self) -> torch.Tensor: ...


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



def load_into_parameter(param: torch.Tensor, tensor: WeightSource, shard_id: object = None) -> None:
    """Write one checkpoint tensor through ``param``'s ``weight_loader`` (a packed parameter's
    takes the shard id too), else ``default_weight_loader``; the one call checkpoint loading
    and live weight updates share."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    with torch.no_grad():
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)

def sharded_parameter(
    data: torch.Tensor, loader: object, output_dim: int | None, input_dim: int | None
) -> nn.Parameter:
    """A frozen parameter with its loader and the dimensions that tensor parallelism splits."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    param.output_dim = output_dim
    param.input_dim = input_dim
    return param


class LinearLayer(Protocol):
    """What a ``LinearMethod`` reads of its layer (``LinearBase``); it registers its own
    parameters on it as attributes (``weight``, ``weight_scale``, ...)."""

    input_size: int  # this rank's shard of the input dimension
    impl: Any  # the layer's implementation (``CustomOp``), whose device the packing serves
    weight_loader: Callable[..., None]


class LinearMethod(abc.ABC):
    """How a linear layer holds its weight: the parameters the checkpoint fills (this rank's
    shard) and the ``PackedWeight`` built from them once they are loaded."""

    @abc.abstractmethod
    def create_weights(self, layer: LinearLayer, input_size: int, output_size: int) -> None:
        """Register ``layer``'s weight parameters for an ``[output_size, input_size]`` shard,
        each with ``layer.weight_loader`` (``sharded_parameter``)."""

    @abc.abstractmethod
    def pack(self, layer: LinearLayer, options: PackOptions) -> PackedWeight:
        """The ``PackedWeight`` of the loaded parameters, for ``layer.impl``."""


class UnquantizedLinearMethod(LinearMethod):
    """One ``weight`` ``[out, in]`` in the model's dtype."""

    def create_weights(self, layer: LinearLayer, input_size: int, output_size: int) -> None:
        weight = torch.empty(output_size, input_size)
        layer.weight = sharded_parameter(weight, layer.weight_loader, output_dim=0, input_dim=1)

    def pack(self, layer: LinearLayer, options: PackOptions) -> PackedWeight:
        return pack_float_weight(layer.weight.detach(), layer.impl, options)
