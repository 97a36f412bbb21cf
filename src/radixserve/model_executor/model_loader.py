"""Build a model from the registry and fill it from safetensors files.

Each checkpoint tensor goes to the ``weight_loader`` of the parameter it belongs to; tensors of a
fused layer (``q_proj`` → ``qkv_proj`` shard ``"q"``, ``gate_proj`` → ``gate_up_proj`` shard 0)
are routed through the model's ``packed_modules_mapping``. After loading, every parameter (and
every shard of a fused one) must have been filled, or loading fails naming what is missing.

The model is built inside ``build_context`` (its ops pick their device implementation then, see
``layers/custom_op.py``) and packed by ``prepack_model`` once loading is done: the layouts a
device's kernels read are made from the loaded (per-rank) parameters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import psutil
import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.layers.attention import AttentionBackend
from radixserve.layers.custom_op import build_context
from radixserve.layers.linear import default_weight_loader
from radixserve.layers.packed_weight import prepack_model
from radixserve.model_config import ModelConfig
from radixserve.model_executor.models import get_model_class
from radixserve.model_executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_LM_HEAD = "lm_head.weight"


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else every file."""
    model_dir = Path(model_path)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shard files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return files


def _skipped(name: str) -> bool:
    # Old checkpoints store RoPE frequencies and BERT's position ids: we derive both.
    return name.endswith(("rotary_emb.inv_freq", "embeddings.position_ids"))


def _checkpoint_tensors(files: list[Path]) -> list[tuple[Path, str]]:
    """Every (file, tensor name) pair, read from the safetensors headers only."""
    tensors = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            tensors.extend((path, name) for name in f.keys() if not _skipped(name))
    return tensors


def checkpoint_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the model's weights take once loaded in ``dtype`` (from the headers, no data read),
    so memory can be planned before loading."""
    numel = 0
    for path in checkpoint_files(config.model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if _skipped(name) or (config.tie_word_embeddings and name == _LM_HEAD):
                    continue
                shape = f.get_slice(name).get_shape()
                numel += math.prod(shape)
    return numel * dtype.itemsize


def load_model(
    config: ModelConfig,
    attn_backend: AttentionBackend | None,
    device: torch.device,
    batch_invariant: bool = False,
) -> LlamaForCausalLM:
    """Build ``config.architecture`` on ``device`` in ``config.torch_dtype``, load its weights
    and pack them for the device's kernels."""
    model_cls = get_model_class(config.architecture)
    with build_context(device, config.torch_dtype):
        model = model_cls(config, attn_backend)
    load_weights(model, config.model_path)
    prepack_model(model, psutil.virtual_memory().total, batch_invariant)
    return model.eval()


def load_weights(model: LlamaForCausalLM, model_path: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``model_path``.

    ``lm_head`` is tied to the input embedding when the model is tied or the checkpoint has no
    ``lm_head.weight``; unknown tensors are skipped with a warning.
    """
    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as embed
    fused_shards: dict[str, set[str | int]] = {}
    for fused, shard_id in model.packed_modules_mapping.values():
        fused_shards.setdefault(fused, set()).add(shard_id)
    loaded: dict[str, set[str | int | None]] = {}
    tensors = _checkpoint_tensors(checkpoint_files(model_path))
    if _LM_HEAD in params and all(name != _LM_HEAD for _, name in tensors):
        logger.info("checkpoint has no %s: tying it to the input embedding", _LM_HEAD)
        model.tie_word_embeddings()
        params.pop(_LM_HEAD)

    unexpected: list[str] = []
    handles: dict[Path, safe_open] = {}
    with contextlib.ExitStack() as stack:
        for path, name in tqdm(tensors, desc="Loading weights", unit="tensor", leave=False):
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            target, shard_id = route_checkpoint_name(name, model.packed_modules_mapping)
            param = params.get(target)
            if param is None:
                if name != _LM_HEAD:  # a tied checkpoint may still store lm_head
                    unexpected.append(name)
                continue
            tensor = handles[path].get_tensor(name)
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            loaded.setdefault(target, set()).add(shard_id)

    if unexpected:
        logger.warning("ignored %d checkpoint tensors: %s", len(unexpected), unexpected[:10])
    missing = []
    for name in params:
        module_name = name.rsplit(".", 2)[-2]
        for shard_id in sorted(fused_shards.get(module_name, {None}), key=str):
            if shard_id not in loaded.get(name, set()):
                missing.append(name if shard_id is None else f"{name} (shard {shard_id!r})")
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks parameters: {', '.join(missing)}")


def route_checkpoint_name(
    name: str, packed_modules_mapping: dict[str, tuple[str, str | int]]
) -> tuple[str, str | int | None]:
    """Checkpoint tensor name → (model parameter name, shard id or None)."""
    for module, (fused, shard_id) in packed_modules_mapping.items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{fused}."), shard_id
    return name, None
