"""Reading a PEFT LoRA adapter folder and checking it against the served model.

A folder holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and ``adapter_model.safetensors``
with one ``lora_A`` ``[r, in]`` and one ``lora_B`` ``[out, r]`` tensor per adapted module,
named after the Hugging Face module (``base_model.model.model.layers.3.self_attn.q_proj.
lora_A.weight``). The delta of a module is ``scaling * B @ A`` with ``scaling = lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` when the config says ``use_rslora``.

Everything the engine cannot honour is refused here, with the reason, before any weight is
placed: a missing file, a rank above ``--max-lora-rank``, a target module outside
``LORA_TARGET_MODULES`` (or outside ``--lora-target-modules``), a tensor whose shape is not the
served model's (an adapter trained on another base), and PEFT options that change the maths
(DoRA, per-module ranks, trained biases, ``modules_to_save``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.model_executor.models.llama import LlamaForCausalLM

# Hugging Face module name → (our fused module, shard of it): the Llama family's fused modules
# (the model's own mapping, which its weight loader uses too) and the two unfused ones.
LORA_TARGET_MODULES: dict[str, tuple[str, str | int]] = {
    **LlamaForCausalLM.packed_modules_mapping,
    "o_proj": ("o_proj", 0),
    "down_proj": ("down_proj", 0),
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter folder the engine cannot serve; the message says which file and why."""


@dataclass(frozen=True)
class ModuleShapes:
    """``(in, out)`` of each adaptable Hugging Face module of the served model, and its layer
    count: what an adapter's tensors must match."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def from_config(cls, config: Any) -> ModuleShapes:
        """From a ``ModelConfig`` (whole, unsharded sizes)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return cls(config.num_hidden_layers, {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        })


@dataclass
class LoRAAdapter:
    """One adapter read from disk: ``weights[(layer, hf_module)] = (A [r, in], B [out, r])``
    in float32, ``scaling`` already multiplied into B."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_config(path: str | Path) -> dict[str, Any]:
    """The adapter folder's ``adapter_config.json`` (``LoRAAdapterError`` when absent)."""
    return _read_config(Path(path))


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {folder} does not exist")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{config_path} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path} is not a JSON object")
    return config


def _target_modules(config: dict[str, Any], allowed: tuple[str, ...], where: Path) -> tuple[
    str, ...
]:
    targets = config.get("target_modules")
    if targets == "all-linear":
        return tuple(m for m in LORA_TARGET_MODULES if m in allowed)
    if isinstance(targets, str) or not targets:
        raise LoRAAdapterError(
            f"{where}: target_modules must be a list of module names or 'all-linear', "
            f"got {targets!r}"
        )
    for module in targets:
        if module not in LORA_TARGET_MODULES:
            raise LoRAAdapterError(
                f"{where}: target module {module!r} is not one this model can adapt "
                f"(supported: {', '.join(LORA_TARGET_MODULES)})"
            )
        if module not in allowed:
            raise LoRAAdapterError(
                f"{where}: target module {module!r} is not in --lora-target-modules "
                f"({', '.join(allowed)})"
            )
    return tuple(targets)


def _check_options(config: dict[str, Any], where: Path) -> None:
    """Refuse the PEFT options whose maths this engine does not implement."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {config['peft_type']!r} is not LORA")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
    }
    bad = [name for name, set_ in refused.items() if set_]
    if bad:
        raise LoRAAdapterError(f"{where}: unsupported PEFT options set: {', '.join(bad)}")


def load_adapter(
    name: str,
    path: str | Path,
    model: ModuleShapes,
    max_rank: int,
    allowed_targets: tuple[str, ...] = tuple(LORA_TARGET_MODULES),
) -> LoRAAdapter:
    """Read and check the adapter at ``path`` for a model of ``model``'s shapes."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = _read_config(folder)
    where = folder / CONFIG_FILE
    _check_options(config, where)
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"{where}: rank {rank} is above --max-lora-rank {max_rank}"
        )
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = _target_modules(config, allowed_targets, where)

    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        hint = " (convert adapter_model.bin to safetensors)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise LoRAAdapterError(f"{folder} has no {WEIGHTS_FILE}{hint}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise LoRAAdapterError(f"{weights_path} is not a readable safetensors file: {e}") from e

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_NAME.match(key)
        if match is None:
            raise LoRAAdapterError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight of "
                                   "a decoder layer's projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in targets:
            raise LoRAAdapterError(
                f"{weights_path}: tensor {key!r} adapts {module!r}, which target_modules "
                "does not list"
            )
        if layer >= model.num_layers:
            raise LoRAAdapterError(
                f"{weights_path}: tensor {key!r} is for layer {layer}; the model has "
                f"{model.num_layers} layers (an adapter of another base model?)"
            )
        parts.setdefault((layer, module), {})[which] = tensor

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(
                f"{weights_path}: layer {layer} {module} has lora_{''.join(ab)} but not both A "
                "and B"
            )
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        fan_in, fan_out = model.shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAAdapterError(
                f"{weights_path}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit this model's [{fan_out}, {fan_in}] weight at rank "
                f"{rank} (an adapter of another base model?)"
            )
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise LoRAAdapterError(f"{weights_path} holds no LoRA weights")
    return LoRAAdapter(name, str(folder), rank, scaling, targets, weights)
