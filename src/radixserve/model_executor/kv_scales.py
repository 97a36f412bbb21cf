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

A JSON file (SGLang's and vLLM's ``--quantization-param-path``, ``read_kv_scales_file``) may give
them instead: one scale per layer for K and V alike, per tensor-parallel rank; it replaces the
checkpoint's.

They are not weights: the loader skips them (``is_kv_scale_name``) and the model runner hands
them to the KV pool, which quantizes each layer's K and V under its own scales and tells the
attention backends. A scale is one positive finite number per layer (per-head or per-channel
scales are refused, not averaged). Any other KV dtype has no use for them, which the runner
logs; an fp8 cache over a checkpoint without them runs at scale 1.0, as SGLang and vLLM do.
"""

from __future__ import annotations

import json
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


def _file_error(path: str | Path, what: str) -> ValueError:
    return ValueError(f"--quantization-param-path {path}: {what}")


def read_kv_scales_file(path: str | Path, tp_rank: int, tp_size: int, num_layers: int,
                        model_type: str | None) -> CheckpointKVScales:
    """Tensor-parallel rank ``tp_rank``'s KV scales in the JSON file at ``path``, the format
    SGLang and vLLM read for ``--quantization-param-path``::

        {"model_type": "llama",
         "kv_cache": {"dtype": "float8_e4m3fn",
                      "scaling_factor": {"0": {"0": 0.0152, "1": 0.0174, ...}}}}

    ``scaling_factor`` maps each of ``tp_size`` ranks to a scale for each of the model's
    ``num_layers`` layers, used for K and V alike. Anything else (another model type, dtype or
    rank count, a layer missing, a scale not positive and finite) is refused: SGLang falls back
    to scale 1.0 with a log line, which would serve a silently clipped cache."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _file_error(path, f"unreadable: {e}") from None
    kv_cache = data.get("kv_cache") if isinstance(data, dict) else None
    if not isinstance(kv_cache, dict) or not isinstance(kv_cache.get("scaling_factor"), dict):
        raise _file_error(path, 'no "kv_cache": {"scaling_factor": ...} object')
    if data.get("model_type", model_type) != model_type:
        raise _file_error(path, f"its scales are for a {data['model_type']} model, this one is "
                                f"{model_type}")
    if kv_cache.get("dtype", "float8_e4m3fn") != "float8_e4m3fn":
        raise _file_error(path, f"its scales are for a {kv_cache['dtype']} KV cache; the file "
                                "format holds float8_e4m3fn scales")
    ranks = kv_cache["scaling_factor"]
    if sorted(ranks) != sorted(str(r) for r in range(tp_size)):
        raise _file_error(path, f"it has scales for tensor-parallel ranks {sorted(ranks)}; this "
                                f"server runs {tp_size} (--tp-size)")
    layers = ranks[str(tp_rank)]
    if not isinstance(layers, dict) or sorted(layers) != sorted(str(i) for i in range(num_layers)):
        found = sorted(layers) if isinstance(layers, dict) else layers
        raise _file_error(path, f"rank {tp_rank}'s scales name layers {found}; the model has "
                                f"{num_layers}")
    scales: dict[int, float] = {}
    for key, value in layers.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0):
            raise _file_error(path, f"layer {key}'s scale is {value!r}: it must be a positive, "
                                    "finite number")
        scales[int(key)] = float(value)
    return CheckpointKVScales(dict(scales), dict(scales))


def pool_layer_scales(model_path: str | Path, kv_dtype: torch.dtype, layers: range,
                      file_scales: CheckpointKVScales | None = None, quiet: bool = False,
                      ) -> list[tuple[float, float]] | None:
    """The (K, V) scale of each of ``layers`` for a KV pool of ``kv_dtype`` over the checkpoint
    at ``model_path``: for an fp8 pool ``file_scales`` (``--quantization-param-path``) or the
    checkpoint's calibrated scales, or ``TENSOR_SCALE`` for every layer when neither has any;
    None for a dtype without per-layer scales (``ServerArgs`` gives ``file_scales`` to fp8 pools
    only). Says in the log what it chose, unless ``quiet``
    (a weight update checking that its checkpoint keeps the served scales)."""

    def say(level: int, message: str, *args: object) -> None:
        if not quiet:
            logger.log(level, message, *args)

    scales = read_kv_scales(model_path)
    per_layer = is_quantized(kv_dtype) and not has_row_scales(kv_dtype)
    if not per_layer:
        if scales:
            say(logging.INFO, "the checkpoint's KV-cache scales are unused: the KV cache "
                "stores %s", kv_dtype_name(kv_dtype))
        return None
    if file_scales is not None:
        if scales:
            say(logging.WARNING, "--quantization-param-path's KV-cache scales replace the "
                "checkpoint's k_scale / v_scale")
        scales = file_scales
    if not scales:
        say(logging.WARNING, "KV cache %s at scale %s: the checkpoint has no calibrated "
            "k_scale / v_scale, so K and V past +-%s are clipped", kv_dtype_name(kv_dtype),
            TENSOR_SCALE, Q_MAX[kv_dtype] * TENSOR_SCALE)
        return [(TENSOR_SCALE, TENSOR_SCALE)] * len(layers)
    chosen = scales.for_layers(layers)
    say(logging.INFO, "KV cache %s under the %s scales: K %.4g-%.4g, V %.4g-%.4g",
        kv_dtype_name(kv_dtype),
        "checkpoint's" if file_scales is None else "--quantization-param-path",
        min(k for k, _ in chosen), max(k for k, _ in chosen),
        min(v for _, v in chosen), max(v for _, v in chosen))
    return chosen
