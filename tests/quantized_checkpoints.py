"""W8A16 checkpoints written by the compressed-tensors library itself (the format llm-compressor
produces), from a float test checkpoint: int8 weights, symmetric, per channel or per group,
``pack-quantized``, lm_head left in float. transformers reads them back (decompressing) as the
reference."""

from __future__ import annotations

from pathlib import Path

import torch


def build_w8a16_checkpoint(
    float_path: Path, out_dir: Path, group_size: int | None = None
) -> Path:
    """Quantise ``float_path``'s linear layers (absmax scales) and save them compressed."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.bfloat16)
    weights = QuantizationArgs(
        num_bits=8, type="int", symmetric=True,
        strategy="group" if group_size else "channel", group_size=group_size,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach().float()
            w = w.reshape(w.shape[0], -1, group_size or w.shape[1])
            module.weight_scale.data = (w.abs().amax(-1) / 127).to(module.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    AutoTokenizer.from_pretrained(float_path).save_pretrained(out_dir)
    return out_dir
