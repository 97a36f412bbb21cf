"""Int8 and 4-bit weights: quantised at load from a float checkpoint, or loaded pre-quantised.

``resolve_quantization`` turns ``--quantization`` and the checkpoint's ``quantization_config``
into one ``QuantizationConfig`` (or None: float weights), raising ``ValueError`` for anything
it cannot honour, before any process starts. Linear layers then take their ``LinearMethod``
from it, and the LM head its packing:

    int8                 ``--quantization int8`` on a float checkpoint: every linear layer and
                         the LM head are quantised when the model is packed, per output channel,
                         symmetrically (``int8.py``)
    int4                 ``--quantization int4``: the linear layers at 4 bits, a scale and an
                         offset per 32 inputs (GGUF's Q4_1 arithmetic), the LM head at int8
                         (``int4.py``)
    compressed-tensors   a checkpoint written by llm-compressor / compressed-tensors with the
                         W8A16 scheme (int8 weights, symmetric, per channel or per group,
                         ``pack-quantized``); its lm_head stays as stored
                         (``compressed_tensors.py``)

The int8 ones run on ``csrc/linear_int8.cpp`` through ``Int8Weight``, the 4-bit ones on
``csrc/linear_int4.cpp`` through ``Int4Weight``.
"""

from __future__ import annotations

from typing import Any

from radixserve.layers.quantization.base import QuantizationConfig

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "resolve_quantization"]

QUANTIZATION_METHODS = ("int8", "int4")


def resolve_quantization(
    requested: str | None, hf_config: dict[str, Any]
) -> QuantizationConfig | None:
    """The quantisation a model runs with: the checkpoint's when it is pre-quantised (then
    ``requested`` may only name the same kind), else ``requested``."""
    from radixserve.layers.quantization.compressed_tensors import CompressedTensorsW8A16
    from radixserve.layers.quantization.int4 import Int4AtLoad
    from radixserve.layers.quantization.int8 import Int8AtLoad

    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_METHODS}, got {requested!r}"
        )
    stored = hf_config.get("quantization_config")
    if stored is None:
        at_load = {"int8": Int8AtLoad, "int4": Int4AtLoad}
        return at_load[requested]() if requested is not None else None
    method = stored.get("quant_method") if isinstance(stored, dict) else None
    if method != "compressed-tensors":
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported; radixserve loads "
            "compressed-tensors W8A16 checkpoints, or quantises a float checkpoint with "
            "--quantization int8"
        )
    return CompressedTensorsW8A16.from_config(stored)
