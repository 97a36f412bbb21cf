"""A checkpoint's calibrated KV-cache scales: the per-layer ``k_scale`` / ``v_scale`` an fp8 KV
cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) stores its codes under.

Checkpoints quantized for an fp8 KV cache (llm-compressor, ModelOpt, AutoFP8) carry one scale per
attention layer for K and one for V, which SGLang and vLLM read instead of the unit scale
(``kv_quant.TENSOR_SCALE``). Their names vary with the tool that wrote them; all of these are
read (``i`` a decoder layer):

- ``model.layers.i.self_attn.k_scale`` and ``.v_scale`` (also under ``self_attn.attn.``);
- ``model.layers.i.self_attn.kv_scale``: one scale for both (older AutoFP8 checkpoints);
- ``model.layers.i.self_attn.k_proj.output_scale`` and ``v_proj.output_scale``
  (compressed-tensors).

They are not weights: the loader skips them (``is_kv_scale_name``) and the model runner hands
them to the KV pool, which quantizes each layer's K and V under its own scales and tells the
attention backends. A scale is one positive finite number per layer (per-head or per-channel
scales are refused, not averaged). Any other KV dtype has no use for them, which the runner
logs; an fp8 cache over a checkpoint without them runs at scale 1.0, as SGLang and vLLM do.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from radixserve.gguf_file import find_gguf
from radixserve.mem_cache.kv_quant import (
    Q_MAX,
    TENSOR_SCALE,
    has_row_scales,
    is_quantized,
    kv_dtype_name,
)
from radixserve.model_executor.checkpoint_files import checkpoint_files

logger = logging.getLogger(__name__)

# (layer, which): which is "k", "v" or "kv" (one scale for both)
_NAMES = (
    re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$"),
    re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"),
)


def _parse(name: str) -> tuple[int, str] | None:
    for pattern in _NAMES:
        match = pattern.match(name)
        if match:
            return int(match.group(1)), match.group(2)
    return None


def is_kv_scale_name(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a KV-cache scale (not a weight)."""
    return _parse(name) is not None


@dataclass(frozen=True)
class CheckpointKVScales:
    """The K and V scale of each decoder layer that has them, by the checkpoint's layer index."""

    k: dict[int, float]
    v: dict[int, float]

    def __bool__(self) -> bool:
        return bool(self.k or self.v)

    def for_layers(self, layers: range) -> list[tuple[float, float]]:
        """(K scale, V scale) of each of ``layers`` (a pipeline stage's, in order): the KV pool's
        layer ``j`` is ``layers[j]``. Every layer must have both: a checkpoint calibrated for
        some layers only is refused rather than mixed with unit scales."""
        missing = [i for i in layers if i not in self.k or i not in self.v]
        if missing:
            raise ValueError(
                f"the checkpoint's KV-cache scales (k_scale / v_scale) cover layers "
                f"{sorted(set(self.k) & set(self.v))}, not {missing}: an fp8 KV cache needs "
                f"them for every layer (or none, for scale {TENSOR_SCALE})"
            )
        return [(self.k[i], self.v[i]) for i in layers]


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name} holds {tensor.numel()} KV-cache scales "
            f"(shape {list(tensor.shape)}): only one scale per layer is supported"
        )
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"checkpoint tensor {name} is a KV-cache scale of {value}: it must be "
                         f"positive and finite")
    return value


def kv_scales_from_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> CheckpointKVScales:
    """The KV-cache scales among ``tensors`` (checkpoint name, tensor); other names are passed
    over. A layer given a scale twice (``kv_scale`` and ``k_scale``, say) must agree."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for name, tensor in tensors:
        parsed = _parse(name)
        if parsed is None:
            continue
        layer, which = parsed
        value = _scale_value(name, tensor)
        for part in ("k", "v") if which == "kv" else (which,):
            if found[part].setdefault(layer, value) != value:
                raise ValueError(
                    f"layer {layer}'s {part.upper()} scale is given twice, as "
                    f"{found[part][layer]} and {value} ({name})"
                )
    return CheckpointKVScales(found["k"], found["v"])


def read_kv_scales(model_path: str | Path) -> CheckpointKVScales:
    """The KV-cache scales of the safetensors checkpoint at ``model_path`` (none for a GGUF
    file): only their tensors are read, from the files' headers on."""
    if find_gguf(model_path) is not None:
        return CheckpointKVScales({}, {})
    tensors: list[tuple[str, torch.Tensor]] = []
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            tensors.extend((name, f.get_tensor(name)) for name in f.keys()
                           if is_kv_scale_name(name))
    return kv_scales_from_tensors(tensors)


def pool_layer_scales(model_path: str | Path, kv_dtype: torch.dtype,
                      layers: range) -> list[tuple[float, float]] | None:
    """The (K, V) scale of each of ``layers`` for a KV pool of ``kv_dtype`` over the checkpoint
    at ``model_path``: for an fp8 pool its calibrated scales, or ``TENSOR_SCALE`` for every
    layer when it has none; None for a dtype without per-layer scales. Says in the log what it
    chose."""
    scales = read_kv_scales(model_path)
    per_layer = is_quantized(kv_dtype) and not has_row_scales(kv_dtype)
    if not per_layer:
        if scales:
            logger.info("the checkpoint's KV-cache scales are unused: the KV cache stores %s",
                        kv_dtype_name(kv_dtype))
        return None
    if not scales:
        logger.warning(
            "KV cache %s at scale %s: the checkpoint has no calibrated k_scale / v_scale, so "
            "K and V past +-%s are clipped", kv_dtype_name(kv_dtype), TENSOR_SCALE,
            Q_MAX[kv_dtype] * TENSOR_SCALE,
        )
        return [(TENSOR_SCALE, TENSOR_SCALE)] * len(layers)
    chosen = scales.for_layers(layers)
    logger.info("KV cache %s under the checkpoint's scales: K %.4g-%.4g, V %.4g-%.4g",
                kv_dtype_name(kv_dtype), min(k for k, _ in chosen), max(k for k, _ in chosen),
                min(v for _, v in chosen), max(v for _, v in chosen))
    return chosen
