"""Checkpoints quantised by llm-compressor / compressed-tensors with the W8A16 scheme.

Such a checkpoint's ``config.json`` has a ``quantization_config`` with ``quant_method:
"compressed-tensors"``, format ``pack-quantized`` and one config group whose weights are 8-bit
``int``, ``symmetric``, ``strategy`` ``channel`` or ``group`` (any ``group_size``), not dynamic,
with no input activation quantisation, targeting ``Linear`` and ignoring ``lm_head``. Each
quantised ``<module>`` stores:

    <module>.weight_packed  int32 [out, ceil(in / 4)]: four int8 values per word, value i of a
                            word in its byte i (bits 8i..8i+7), each stored as value + 128
    <module>.weight_scale   [out, 1] (channel) or [out, in / group_size], the model's dtype
    <module>.weight_shape   [2]: out, in

Anything else in a ``compressed-tensors`` config is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from radixserve.layers.linear_method import LinearMethod, WeightSource, sharded_parameter
from radixserve.layers.packed_weight import PackedWeight, PackOptions
from radixserve.layers.quantization.base import QuantizationConfig
from radixserve.layers.quantization.int8 import pack_int8

if TYPE_CHECKING:
    from radixserve.layers.linear_method import LinearLayer

_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
_STRATEGIES = ("channel", "group")
_OFFSET = 128  # pack-quantized stores value + 2^(bits - 1)


def unpack_int8(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """``weight_packed`` (int32 ``[out, ceil(in / 4)]``) → int8 ``[out, in]``."""
    as_bytes = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)
    if as_bytes.shape[1] < in_features:
        raise ValueError(f"weight_packed holds {as_bytes.shape[1]} values per row, "
                         f"the layer takes {in_features}")
    return (as_bytes[:, :in_features].to(torch.int16) - _OFFSET).to(torch.int8)


def _check_weight_shape(param: torch.Tensor, loaded: WeightSource, *shard: object) -> None:
    """``weight_shape`` carries no data the layer needs; it must only be well formed (its
    shape is all this reads: the checkpoint tensor may be a lazy ``SafetensorsSlice``)."""
    if math.prod(loaded.shape) != 2:
        raise ValueError(f"weight_shape must hold [out, in], got {tuple(loaded.shape)}")


class CompressedTensorsW8A16Method(LinearMethod):
    def __init__(self, group_size: int | None) -> None:
        self.group_size = group_size

    def create_weights(self, layer: LinearLayer, input_size: int, output_size: int) -> None:
        if self.group_size and input_size % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide a linear layer's "
                             f"{input_size} inputs")
        groups = input_size // self.group_size if self.group_size else 1
        packed = torch.empty(output_size, -(-input_size // 4), dtype=torch.int32)
        layer.weight_packed = sharded_parameter(
            packed, layer.weight_loader, output_dim=0, input_dim=1
        )
        layer.weight_scale = sharded_parameter(
            torch.empty(output_size, groups, dtype=torch.float32), layer.weight_loader,
            output_dim=0, input_dim=1 if self.group_size else None,
        )
        layer.weight_shape = sharded_parameter(
            torch.empty(0, dtype=torch.int64), _check_weight_shape, output_dim=None,
            input_dim=None,
        )

    def pack(self, layer: LinearLayer, options: PackOptions) -> PackedWeight:
        q = unpack_int8(layer.weight_packed.detach(), layer.input_size)
        return pack_int8(q, layer.weight_scale.detach(), layer.impl)


class CompressedTensorsW8A16(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, group_size: int | None) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsW8A16:
        """Validate a checkpoint's ``quantization_config``; ``ValueError`` names what is not
        W8A16."""

        def refuse(what: str) -> ValueError:
            return ValueError(
                f"compressed-tensors checkpoint: {what}; radixserve loads the W8A16 scheme "
                "(pack-quantized int8 weights, symmetric, per channel or group, no activation "
                "quantisation, lm_head ignored)"
            )

        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise refuse(f"{len(groups)} config groups (one is supported)")
        (group,) = groups.values()
        fmt = group.get("format") or config.get("format")
        if fmt != "pack-quantized":
            raise refuse(f"format {fmt!r}")
        if group.get("input_activations") or group.get("output_activations"):
            raise refuse("activations are quantised")
        weights = group.get("weights") or {}
        for key, value in _WEIGHTS.items():
            if weights.get(key) != value:
                raise refuse(f"weights {key}={weights.get(key)!r} (need {value!r})")
        strategy = weights.get("strategy")
        if strategy not in _STRATEGIES:
            raise refuse(f"weights strategy {strategy!r}")
        if group.get("targets") != ["Linear"]:
            raise refuse(f"targets {group.get('targets')!r} (need ['Linear'])")
        ignore = config.get("ignore") or []
        if ignore != ["lm_head"]:
            raise refuse(f"ignore {ignore!r} (need ['lm_head'])")
        group_size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise refuse(f"group_size {group_size!r}")
        return cls(group_size)

    def linear_method(self) -> LinearMethod:
        return CompressedTensorsW8A16Method(self.group_size)

    def quantizes_lm_head(self) -> bool:
        return False
