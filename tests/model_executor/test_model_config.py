"""ModelConfig.from_path: dtype resolution, shapes, RoPE parameters, EOS ids and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.layers.rotary_embedding import compute_inv_freq
from radixserve.model_config import ModelConfig, cpu_supports_bf16, resolve_device, resolve_dtype

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    """Copy a checkpoint and edit its config.json (a ``None`` value deletes the key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtype_is_used_as_given(llama_path, name, dtype):
    assert ModelConfig.from_path(llama_path, dtype=name).torch_dtype == dtype


def test_auto_dtype_takes_float32_checkpoint_dtype(llama_path):
    assert ModelConfig.from_path(llama_path, dtype="auto").torch_dtype == torch.float32


@pytest.mark.parametrize(
    ("checkpoint", "device", "has_bf16", "expected"),
    [
        ("bfloat16", CUDA, False, torch.bfloat16),
        ("float16", CUDA, False, torch.float16),
        ("float16", CPU, True, torch.bfloat16),
        ("float16", CPU, False, torch.float32),
        ("bfloat16", CPU, True, torch.bfloat16),
        ("bfloat16", CPU, False, torch.float32),
        ("torch.bfloat16", CPU, True, torch.bfloat16),
        (None, CPU, True, torch.float32),
        (None, CUDA, True, torch.float32),
    ],
)
def test_auto_dtype_rules(checkpoint, device, has_bf16, expected):
    assert resolve_dtype("auto", checkpoint, device, cpu_has_bf16=has_bf16) == expected


def test_auto_dtype_reads_legacy_torch_dtype_key(llama_path, tmp_path):
    path = _copy_with_config(llama_path, tmp_path / "ckpt", dtype=None, torch_dtype="bfloat16")
    expected = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    assert ModelConfig.from_path(path, dtype="auto", device="cpu").torch_dtype == expected


def test_unsupported_checkpoint_dtype_is_rejected():
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("auto", "float64", CPU, cpu_has_bf16=True)


def test_resolve_device_auto_picks_cuda_only_when_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == CPU


def test_fields_come_from_config_json(llama_path):
    cfg = ModelConfig.from_path(llama_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 2, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.context_len == cfg.max_position_embeddings == 1024
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, [1])
    assert cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.hf_config["model_type"] == "llama"


def test_explicit_head_dim_wins_over_hidden_over_heads(checkpoint_factory):
    cfg = ModelConfig.from_path(checkpoint_factory("qwen3"))
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
    assert cfg.tie_word_embeddings is True


def test_head_dim_defaults_to_hidden_over_heads(llama_path, tmp_path):
    path = _copy_with_config(llama_path, tmp_path / "ckpt", head_dim=None)
    assert ModelConfig.from_path(path).head_dim == 64 // 4


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_scaling_is_parsed_and_inv_freq_matches_transformers(kind, rope_checkpoint):
    path = rope_checkpoint(kind)
    cfg = ModelConfig.from_path(path)
    assert cfg.rope_scaling["rope_type"] == kind
    assert cfg.rope_theta == 10000.0
    ours = compute_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    theirs, _ = ROPE_INIT_FUNCTIONS[kind](AutoConfig.from_pretrained(path), torch.device("cpu"))
    assert torch.equal(ours, theirs)


def test_transformers4_rope_layout_is_understood(llama_path, tmp_path):
    """Top-level ``rope_theta`` plus ``rope_scaling`` with the old ``type`` key; llama3 without
    ``original_max_position_embeddings`` falls back to ``max_position_embeddings``."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    path = _copy_with_config(
        llama_path, tmp_path / "l3", rope_parameters=None, rope_theta=500000.0, rope_scaling=llama3
    )
    cfg = ModelConfig.from_path(path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 1024

    linear = {"type": "linear", "factor": 2.0}
    path = _copy_with_config(
        llama_path, tmp_path / "lin", rope_parameters=None, rope_theta=1e6, rope_scaling=linear
    )
    cfg = ModelConfig.from_path(path)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})


def test_unsupported_rope_type_is_rejected(llama_path, tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    path = _copy_with_config(llama_path, tmp_path / "ckpt", rope_parameters=yarn)
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_path(path)


def test_eos_ids_are_the_union_of_config_and_generation_config(llama_path, tmp_path):
    path = _copy_with_config(llama_path, tmp_path / "ckpt", eos_token_id=[1, 5])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_path(path).eos_token_ids == [1, 5, 7]

    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert ModelConfig.from_path(path).eos_token_ids == [1, 5, 9]

    (path / "generation_config.json").unlink()
    assert ModelConfig.from_path(path).eos_token_ids == [1, 5]


def test_context_length_override_caps_context(llama_path):
    assert ModelConfig.from_path(llama_path, context_length=100).context_len == 100


def test_context_length_larger_than_model_is_rejected(llama_path):
    with pytest.raises(ValueError, match="context_length 4096 is larger.*1024"):
        ModelConfig.from_path(llama_path, context_length=4096)


def test_missing_config_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json not found"):
        ModelConfig.from_path(tmp_path)


def test_unsupported_architecture_names_supported_ones(llama_path, tmp_path):
    path = _copy_with_config(llama_path, tmp_path / "ckpt", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_path(path)


def test_missing_weight_files_are_rejected(llama_path, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(llama_path, path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors weights"):
        ModelConfig.from_path(path)
