"""Weight loading: sharded checkpoints, fused q/k/v and gate/up, tied embeddings, bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import build_checkpoint
from tests.model_executor.harness import make_runner


def _rewrite_weights(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, passing its tensors through ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def sharded_path(tmp_path_factory) -> Path:
    """The llama test checkpoint (same seed, same weights) split into ~50 KB shards."""
    return build_checkpoint(tmp_path_factory.mktemp("sharded"), "llama", max_shard_size="50KB")


def test_sharded_checkpoint_loads_the_same_weights(llama_path, sharded_path):
    sharded = sharded_path
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single = make_runner(llama_path).model.state_dict()
    loaded = make_runner(sharded).model.state_dict()
    assert single.keys() == loaded.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, loaded[name]), name


def test_fused_projections_hold_the_checkpoint_tensors_in_shard_order(llama_path):
    checkpoint = load_file(llama_path / "model.safetensors")
    layer = make_runner(llama_path).model.model.layers[1]
    prefix = "model.layers.1."
    expected_qkv = torch.cat(
        [checkpoint[f"{prefix}self_attn.{p}_proj.weight"] for p in ("q", "k", "v")]
    )
    assert torch.equal(layer.self_attn.qkv_proj.weight, expected_qkv)
    expected_gate_up = torch.cat(
        [checkpoint[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")]
    )
    assert torch.equal(layer.mlp.gate_up_proj.weight, expected_gate_up)


def test_qkv_bias_is_loaded_for_qwen2(checkpoint_factory):
    path = checkpoint_factory("qwen2")
    checkpoint = load_file(path / "model.safetensors")
    attn = make_runner(path).model.model.layers[0].self_attn
    expected = torch.cat(
        [checkpoint[f"model.layers.0.self_attn.{p}_proj.bias"] for p in ("q", "k", "v")]
    )
    assert torch.equal(attn.qkv_proj.bias, expected)
    assert attn.o_proj.bias is None


def test_tied_checkpoint_shares_embedding_with_lm_head(checkpoint_factory):
    model = make_runner(checkpoint_factory("qwen2")).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_lm_head_ties_it_to_the_embedding(llama_path, tmp_path):
    def drop_lm_head(tensors):
        tensors.pop("lm_head.weight")
        return tensors

    path = _rewrite_weights(llama_path, tmp_path / "ckpt", drop_lm_head)
    model = make_runner(path).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_rotary_inv_freq_buffers_in_checkpoint_are_ignored(llama_path, tmp_path):
    def add_inv_freq(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        return tensors

    path = _rewrite_weights(llama_path, tmp_path / "ckpt", add_inv_freq)
    reference = make_runner(llama_path).model.state_dict()
    for name, tensor in make_runner(path).model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


def test_missing_parameters_are_listed(llama_path, tmp_path):
    def drop_some(tensors):
        tensors.pop("model.layers.0.self_attn.k_proj.weight")
        tensors.pop("model.norm.weight")
        return tensors

    path = _rewrite_weights(llama_path, tmp_path / "ckpt", drop_some)
    with pytest.raises(ValueError, match="lacks parameters") as err:
        make_runner(path)
    assert "model.layers.0.self_attn.qkv_proj.weight (shard 'k')" in str(err.value)
    assert "model.norm.weight" in str(err.value)
    assert "shard 'q'" not in str(err.value)


def test_wrong_tensor_shape_is_rejected(llama_path, tmp_path):
    def shrink(tensors):
        tensors["model.norm.weight"] = torch.ones(32)
        return tensors

    path = _rewrite_weights(llama_path, tmp_path / "ckpt", shrink)
    with pytest.raises(ValueError, match="shape mismatch"):
        make_runner(path)


def test_index_naming_a_missing_shard_is_rejected(sharded_path, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(sharded_path, path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    lost = weight_map["model.norm.weight"]
    (path / lost).unlink()
    with pytest.raises(ValueError, match=f"missing shard files: {lost}"):
        make_runner(path)
