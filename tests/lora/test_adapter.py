"""Reading PEFT adapter folders: scaling, rsLoRA, shapes, and every bad folder refused clearly."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from radixserve.lora import LoRAAdapterError, load_adapter
from radixserve.lora.adapter import ModuleShapes
from radixserve.model_config import ModelConfig
from tests.checkpoints import build_checkpoint
from tests.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def shapes(llama_path):
    return ModuleShapes.from_config(ModelConfig.from_path(str(llama_path)))


@pytest.fixture(scope="module")
def adapter_dir(llama_path, tmp_path_factory):
    return make_adapter(llama_path, tmp_path_factory.mktemp("a") / "a", rank=4,
                        targets=["q_proj", "v_proj", "down_proj"], seed=1, alpha=8)


def test_reads_weights_and_folds_alpha_over_r_into_b(adapter_dir, shapes):
    from safetensors.torch import load_file

    adapter = load_adapter("a", adapter_dir, shapes, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == 8 / 4
    assert set(adapter.target_modules) == {"q_proj", "v_proj", "down_proj"}
    assert len(adapter.weights) == 2 * 3  # two layers, three modules
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    a, b = adapter.weights[(1, "v_proj")]
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    torch.testing.assert_close(a, raw[f"{prefix}.lora_A.weight"])
    torch.testing.assert_close(b, raw[f"{prefix}.lora_B.weight"] * 2.0)


def test_rslora_scales_by_alpha_over_sqrt_r(llama_path, tmp_path, shapes):
    folder = make_adapter(llama_path, tmp_path / "rs", rank=4, targets=["o_proj"], seed=2,
                          alpha=8, use_rslora=True)
    assert load_adapter("rs", folder, shapes, max_rank=8).scaling == 8 / math.sqrt(4)


def _copy(adapter_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(adapter_dir, folder)
    return folder


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_files(adapter_dir, tmp_path, shapes):
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        load_adapter("x", tmp_path / "nowhere", shapes, 8)
    folder = _copy(adapter_dir, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="has no adapter_model.safetensors"):
        load_adapter("x", folder, shapes, 8)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match="has no adapter_config.json"):
        load_adapter("x", folder, shapes, 8)


def test_rank_above_the_maximum(adapter_dir, shapes):
    with pytest.raises(LoRAAdapterError, match="rank 4 is above --max-lora-rank 2"):
        load_adapter("x", adapter_dir, shapes, max_rank=2)


def test_unknown_or_disallowed_target_module(adapter_dir, tmp_path, shapes):
    folder = _copy(adapter_dir, tmp_path)
    _edit_config(folder, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoRAAdapterError, match="'lm_head' is not one this model can adapt"):
        load_adapter("x", folder, shapes, 8)
    with pytest.raises(LoRAAdapterError, match="not in --lora-target-modules"):
        load_adapter("x", adapter_dir, shapes, 8, allowed_targets=("q_proj", "v_proj"))


def test_unsupported_peft_options(adapter_dir, tmp_path, shapes):
    folder = _copy(adapter_dir, tmp_path)
    _edit_config(folder, use_dora=True, bias="lora_only")
    with pytest.raises(LoRAAdapterError, match="unsupported PEFT options set: use_dora, bias"):
        load_adapter("x", folder, shapes, 8)


def test_another_base_models_shapes(tmp_path, shapes):
    other = build_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    folder = make_adapter(other, tmp_path / "wide_adapter", rank=4, targets=["q_proj"], seed=3)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        load_adapter("x", folder, shapes, 8)
