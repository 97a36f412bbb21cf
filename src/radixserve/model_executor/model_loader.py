"""Build a model from the registry and fill it from safetensors files (or a GGUF file, whose
tensors ``model_loader_gguf`` names and reads).

Each checkpoint tensor goes to the ``weight_loader`` of the parameter it belongs to; tensors of a
fused layer (``q_proj`` → ``qkv_proj`` shard ``"q"``, ``gate_proj`` → ``gate_up_proj`` shard 0)
are routed through the model's ``packed_modules_mapping``. After loading, every parameter (and
every shard of a fused one) must have been filled, or loading fails naming what is missing.

A loader receives a ``SafetensorsSlice``: a view of the tensor in the file that reads only what
the loader narrowed it to, so a tensor-parallel rank reads its own shard from disk and never
holds the whole tensor. Tensors of other pipeline stages are not read at all.

The model is built inside ``build_context`` (its ops pick their device implementation then, see
``layers/custom_op.py``) and packed by ``prepack_model`` once loading is done: the layouts a
device's kernels read are made from the loaded (per-rank) parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from radixserve.distributed import ParallelState
from radixserve.gguf_file import find_gguf
from radixserve.layers.attention import AttentionBackend
from radixserve.layers.custom_op import build_context
from radixserve.layers.linear_method import (
    RangedLazyWeight,
    WeightSource,
    load_into_parameter,
)
from radixserve.layers.packed_weight import prepack_model
from radixserve.model_config import ModelConfig
from radixserve.model_executor.checkpoint_files import checkpoint_files
from radixserve.model_executor.kv_scales import is_kv_scale_name
from radixserve.model_executor.model_loader_gguf import gguf_weight_bytes, gguf_weights
from radixserve.model_executor.models.llama import LlamaForCausalLM
from radixserve.model_registry import get_model_class

logger = logging.getLogger(__name__)

_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


class SafetensorsSlice(RangedLazyWeight):
    """A tensor of an open safetensors file, narrowed lazily: ``load`` reads only the slice."""

    def __init__(self, handle: safe_open, name: str) -> None:
        self._slice = handle.get_slice(name)
        self._ranges = [(0, n) for n in self._slice.get_shape()]

    def load(self) -> torch.Tensor:
        return self._slice[tuple(slice(start, stop) for start, stop in self._ranges)]


def _skipped(name: str) -> bool:
    # Old checkpoints store RoPE frequencies and BERT's position ids: we derive both. KV-cache
    # scales are not weights: the model runner reads them for the KV pool (kv_scales.py).
    return name.endswith(("rotary_emb.inv_freq", "embeddings.position_ids")) or (
        is_kv_scale_name(name)
    )


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
    gguf = find_gguf(config.model_path)
    if gguf is not None:
        return gguf_weight_bytes(gguf, config.tie_word_embeddings, dtype)
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
    parallel: ParallelState | None = None,
    batch_invariant: bool = False,
    cpu_kernel_autotune: str = "off",
) -> LlamaForCausalLM:
    """Build ``config.architecture`` on ``device`` in ``config.torch_dtype`` (this rank's part
    of it), load its weights and pack them for the device's kernels."""
    model_cls = get_model_class(config.architecture)
    with build_context(device, config.torch_dtype):
        if parallel is not None and parallel.distributed:
            if not getattr(model_cls, "supports_parallel", False):
                raise ValueError(
                    f"{config.architecture} does not support tensor or pipeline parallelism"
                )
            model = model_cls(config, attn_backend, parallel)
        else:
            model = model_cls(config, attn_backend)
    load_weights(model, config.model_path)
    prepack_model(model, psutil.virtual_memory().total, batch_invariant, cpu_kernel_autotune)
    return model.eval()


def load_weights(model: LlamaForCausalLM, model_path: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``model_path`` (safetensors, or
    a GGUF file: ``model_loader_gguf``)."""
    gguf = find_gguf(model_path)
    if gguf is not None:
        fill_parameters(model, model_path, gguf_weights(gguf))
        return
    handles: dict[Path, safe_open] = {}
    with contextlib.ExitStack() as stack:

        def opener(path: Path, name: str) -> Callable[[], SafetensorsSlice]:
            def open_slice() -> SafetensorsSlice:
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(path, framework="pt"))
                return SafetensorsSlice(handles[path], name)

            return open_slice

        tensors = _checkpoint_tensors(checkpoint_files(model_path))
        fill_parameters(model, model_path, [(name, opener(path, name)) for path, name in tensors])


def fill_parameters(
    model: LlamaForCausalLM,
    model_path: str | Path,
    tensors: list[tuple[str, Callable[[], WeightSource]]],
) -> None:
    """Fill every parameter of ``model`` from ``tensors``: (checkpoint name, a function giving
    the tensor as a ``WeightSource``), names as in a Hugging Face checkpoint.

    ``lm_head`` is tied to the input embedding when the model is tied or the checkpoint has no
    ``lm_head.weight``; unknown tensors are skipped with a warning, tensors of other pipeline
    stages silently.
    """
    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as embed
    fused_shards: dict[str, set[str | int]] = {}
    for fused, shard_id in model.packed_modules_mapping.values():
        fused_shards.setdefault(fused, set()).add(shard_id)
    loaded: dict[str, set[str | int | None]] = {}
    if _LM_HEAD in params and all(name != _LM_HEAD for name, _ in tensors):
        logger.info("checkpoint has no %s: tying it to the input embedding", _LM_HEAD)
        model.tie_word_embeddings()
        if not _lm_head_from_embedding(model):
            params.pop(_LM_HEAD)
    split = getattr(model, "split_checkpoint_tensors", None)  # fused in the checkpoint (Phi-3)
    if split is not None:
        tensors = split(tensors)
    holds_weight = getattr(model, "holds_weight", None)  # pipeline stages: a part of the model
    if holds_weight is not None:
        tensors = [(name, source) for name, source in tensors if holds_weight(name)]

    unexpected: list[str] = []
    for name, source in tqdm(tensors, desc="Loading weights", unit="tensor", leave=False):
        target, shard_id = route_checkpoint_name(name, model.packed_modules_mapping)
        targets = [target]
        if name == _EMBED and _lm_head_from_embedding(model):
            targets = [t for t in (target, _LM_HEAD) if t in params]
        elif target not in params:
            if name != _LM_HEAD:  # a tied checkpoint may still store lm_head
                unexpected.append(name)
            continue
        tensor = source()
        for target in targets:
            load_into_parameter(params[target], tensor, shard_id)
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


def _lm_head_from_embedding(model: nn.Module) -> bool:
    """A tied LM head on a last pipeline stage without the embedding (``LlamaForCausalLM``)."""
    return bool(getattr(model, "lm_head_from_embedding", False))


def route_checkpoint_name(
    name: str, packed_modules_mapping: dict[str, tuple[str, str | int]]
) -> tuple[str, str | int | None]:
    """Checkpoint tensor name → (model parameter name, shard id or None)."""
    for module, (fused, shard_id) in packed_modules_mapping.items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{fused}."), shard_id
    return name, None
