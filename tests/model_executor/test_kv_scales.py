"""A checkpoint's calibrated KV-cache scales (``kv_scales.py``): which tensor names are read, what
is refused, and a real ModelRunner over a checkpoint that carries them: its fp8 pool stores
each layer's K and V under that layer's scales, other KV dtypes leave them unused, and a weight
update to a checkpoint with other scales is refused. The same scales from a JSON file
(``--quantization-param-path``) replace the checkpoint's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from radixserve.model_executor.kv_scales import (
    is_kv_scale_name,
    kv_scales_from_tensors,
    read_kv_scales,
    read_kv_scales_file,
)
from tests.checkpoints import kv_scales_of
from tests.engine.test_quantized_engine import PROMPTS
from tests.model_executor.harness import ManualSlots, make_runner


def one(value: float) -> torch.Tensor:
    return torch.tensor(value)


def test_the_names_each_tool_writes():
    tensors = [
        ("model.layers.0.self_attn.k_scale", one(0.5)),
        ("model.layers.0.self_attn.v_scale", one(0.25)),
        ("model.layers.1.self_attn.kv_scale", one(2.0)),  # older AutoFP8: both
        ("model.layers.2.self_attn.k_proj.output_scale", one(3.0)),  # compressed-tensors
        ("model.layers.2.self_attn.v_proj.output_scale", torch.tensor([4.0])),
        ("model.layers.3.self_attn.attn.k_scale", one(1.5)),
        ("model.layers.3.self_attn.attn.v_scale", one(1.5)),
        ("model.layers.0.self_attn.k_proj.weight", torch.ones(2, 2)),  # a weight: passed over
        ("model.layers.0.self_attn.k_proj.weight_scale", one(9.0)),  # a weight's scale, too
    ]
    scales = kv_scales_from_tensors(tensors)
    assert scales.k == {0: 0.5, 1: 2.0, 2: 3.0, 3: 1.5}
    assert scales.v == {0: 0.25, 1: 2.0, 2: 4.0, 3: 1.5}
    assert [is_kv_scale_name(name) for name, _ in tensors] == [True] * 7 + [False] * 2
    # a pipeline stage's layers, in the pool's order
    assert scales.for_layers(range(1, 3)) == [(2.0, 2.0), (3.0, 4.0)]
    with pytest.raises(ValueError, match=r"not \[4\]"):
        scales.for_layers(range(5))
    assert not kv_scales_from_tensors([("model.norm.weight", torch.ones(4))])


@pytest.mark.parametrize(("tensors", "message"), [
    ([("model.layers.0.self_attn.k_scale", torch.ones(4))], "holds 4 KV-cache scales"),
    ([("model.layers.0.self_attn.k_scale", one(0.0))], "must be positive and finite"),
    ([("model.layers.0.self_attn.v_scale", one(float("nan")))], "must be positive and finite"),
    ([("model.layers.0.self_attn.kv_scale", one(1.0)),
      ("model.layers.0.self_attn.k_scale", one(2.0))], "K scale is given twice"),
])
def test_scales_that_are_refused(tensors, message):
    with pytest.raises(ValueError, match=message):
        kv_scales_from_tensors(tensors)


def layer_count(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["num_hidden_layers"]


def prefill(runner) -> tuple[ManualSlots, torch.Tensor]:
    """PROMPTS prefilled; the slots they took, in order."""
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in PROMPTS]
    runner.forward(slots.extend(seqs, PROMPTS))
    return slots, torch.cat([runner.req_to_token_pool.req_to_token[s.row, :len(p)]
                             for s, p in zip(seqs, PROMPTS, strict=True)])


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_pool_stores_each_layer_under_the_checkpoint_scales(
    llama_path, calibrated_path, kv_cache_dtype, caplog,
):
    """The same prompts through a runner at unit scale and one over the calibrated checkpoint:
    both pools hold the same K and V to fp8's precision, but the calibrated pool's codes are
    those values divided by its layer's scales (a runner that wrote under 1.0 and read under
    the scales would hold K times the scale), and every backend reads the scales the pool
    lists. The loader does not call the scales ignored weights."""
    with caplog.at_level(logging.INFO):
        calibrated = make_runner(calibrated_path, kv_cache_dtype=kv_cache_dtype,
                                 attention_backend="torch_native")
    assert "ignored" not in caplog.text
    assert "under the checkpoint's scales" in caplog.text
    unit = make_runner(llama_path, kv_cache_dtype=kv_cache_dtype, attention_backend="torch_native")
    expected = kv_scales_of(layer_count(llama_path))
    assert calibrated.token_to_kv_pool.layer_scales == expected
    _, slots = prefill(calibrated)
    _, unit_slots = prefill(unit)
    assert torch.equal(slots, unit_slots)
    rel = {"fp8_e4m3": 1 / 8, "fp8_e5m2": 1 / 4}[kv_cache_dtype]  # two roundings to the format
    for layer, (k_scale, v_scale) in enumerate(expected):
        pool, unit_pool = calibrated.token_to_kv_pool, unit.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_scale_buffers(layer)
        assert k_buf[0, 0].item() == k_scale and v_buf[0, 0].item() == v_scale
        for codes, unit_codes, scale in (
            (pool.k_buffer[layer], unit_pool.k_buffer[layer], k_scale),
            (pool.v_buffer[layer], unit_pool.v_buffer[layer], v_scale),
        ):
            value = unit_codes[slots].float()  # the unit-scale pool: codes are values
            stored = codes[slots].float()
            assert not torch.equal(stored, value)
            assert ((stored * scale - value).abs() <= value.abs() * rel + 1e-2 * scale).all()


def test_other_kv_dtypes_leave_the_scales_unused(calibrated_path, caplog):
    with caplog.at_level(logging.INFO):
        runner = make_runner(calibrated_path, kv_cache_dtype="int8")
    assert "KV-cache scales are unused: the KV cache stores int8" in caplog.text
    assert "ignored" not in caplog.text
    assert runner.token_to_kv_pool.row_scaled


def test_an_fp8_pool_without_scales_says_it_runs_at_one(llama_path, caplog):
    assert not read_kv_scales(llama_path)
    with caplog.at_level(logging.WARNING):
        runner = make_runner(llama_path, kv_cache_dtype="fp8_e4m3")
    assert "no calibrated k_scale / v_scale" in caplog.text
    assert runner.token_to_kv_pool.layer_scales == [(1.0, 1.0)] * layer_count(llama_path)


def test_a_weight_update_keeps_the_pool_scales(llama_path, calibrated_path, caplog):
    """The fp8 pool's codes are stored under the served checkpoint's scales: new weights with
    other scales are refused (and the old ones kept), the same scales are taken, without
    logging the start's choice of scales again."""
    runner = make_runner(calibrated_path, kv_cache_dtype="fp8_e4m3")
    before = runner.model
    with pytest.raises(ValueError, match="other KV-cache scales"):
        runner.update_weights_from_disk(str(llama_path), None)
    assert runner.model is before
    with caplog.at_level(logging.INFO):
        runner.update_weights_from_disk(str(calibrated_path), None)
    assert "weights updated from" in caplog.text
    assert "under the checkpoint's scales" not in caplog.text
    assert runner.model is not before
    with pytest.raises(ValueError, match="is a KV-cache scale"):  # nor through a weight sync
        runner.update_weights_from_tensors([("model.layers.0.self_attn.k_scale", one(1.0))])


def scales_file(path: Path, ranks: list[list[float]], model_type: str | None = "llama",
                dtype: str = "float8_e4m3fn") -> Path:
    """A --quantization-param-path file (SGLang's and vLLM's format): rank -> layer -> scale."""
    data = {"kv_cache": {"dtype": dtype, "scaling_factor": {
        str(rank): {str(layer): s for layer, s in enumerate(scales)}
        for rank, scales in enumerate(ranks)}}}
    if model_type is not None:
        data["model_type"] = model_type
    path.write_text(json.dumps(data))
    return path


def test_a_scales_file_gives_each_rank_its_own(tmp_path):
    path = scales_file(tmp_path / "kv.json", [[0.5, 0.25], [2.0, 4.0]])
    rank1 = read_kv_scales_file(path, tp_rank=1, tp_size=2, num_layers=2, model_type="llama")
    assert rank1.for_layers(range(2)) == [(2.0, 2.0), (4.0, 4.0)]  # K and V alike
    rank0 = read_kv_scales_file(path, tp_rank=0, tp_size=2, num_layers=2, model_type="llama")
    assert rank0.for_layers(range(1, 2)) == [(0.25, 0.25)]  # a pipeline stage's layers
    untyped = scales_file(tmp_path / "untyped.json", [[1.5]], model_type=None)
    assert read_kv_scales_file(untyped, 0, 1, 1, "qwen2").k == {0: 1.5}


@pytest.mark.parametrize(("ranks", "kwargs", "message"), [
    ([[1.0, 1.0]], {"model_type": "qwen2"}, "for a qwen2 model, this one is llama"),
    ([[1.0, 1.0]], {"dtype": "float8_e5m2"}, "for a float8_e5m2 KV cache"),
    ([[1.0, 1.0], [1.0, 1.0]], {}, r"ranks \['0', '1'\]; this server runs 1"),
    ([[1.0]], {}, r"name layers \['0'\]; the model has 2"),
    ([[1.0, 1.0, 1.0]], {}, "the model has 2"),
    ([[1.0, 0.0]], {}, "layer 1's scale is 0.0"),
    ([[1.0, float("inf")]], {}, "layer 1's scale is inf"),
    ([[True, 1.0]], {}, "layer 0's scale is True"),
    ([[1.0, "2"]], {}, "layer 1's scale is '2'"),
])
def test_scales_files_that_are_refused(tmp_path, ranks, kwargs, message):
    path = scales_file(tmp_path / "kv.json", ranks, **kwargs)
    with pytest.raises(ValueError, match=message):
        read_kv_scales_file(path, 0, 1, 2, "llama")


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "unreadable"),
    ("[1, 2]", "no \"kv_cache\""),
    ('{"kv_cache": {"dtype": "float8_e4m3fn"}}', "no \"kv_cache\""),
])
def test_unreadable_scales_files_are_refused(tmp_path, text, message):
    path = tmp_path / "kv.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--quantization-param-path {path}: {message}"):
        read_kv_scales_file(path, 0, 1, 2, "llama")


def test_a_scales_file_replaces_the_checkpoint_scales(calibrated_path, tmp_path, caplog):
    """The runner's fp8 pool takes the file's scales over the checkpoint's, says so, and stores
    its codes under them; the other KV dtypes refuse the file rather than leave it unread."""
    layers = layer_count(calibrated_path)
    path = scales_file(tmp_path / "kv.json", [[0.5 + layer for layer in range(layers)]])
    with caplog.at_level(logging.INFO):
        runner = make_runner(calibrated_path, kv_cache_dtype="fp8_e4m3",
                             quantization_param_path=str(path))
    assert "replace the checkpoint's k_scale / v_scale" in caplog.text
    assert "under the --quantization-param-path scales" in caplog.text
    expected = [(0.5 + layer, 0.5 + layer) for layer in range(layers)]
    assert runner.token_to_kv_pool.layer_scales == expected
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_scale_buffers(layers - 1)
    assert k_buf[0, 0].item() == v_buf[0, 0].item() == expected[-1][0]
    runner.update_weights_from_disk(str(calibrated_path), None)  # the file's scales stay
    assert runner.token_to_kv_pool.layer_scales == expected
    with pytest.raises(ValueError, match="needs --kv-cache-dtype fp8_e4m3"):
        make_runner(calibrated_path, kv_cache_dtype="int8", quantization_param_path=str(path))
    with pytest.raises(ValueError, match="is not a file"):
        make_runner(calibrated_path, kv_cache_dtype="fp8_e4m3",
                    quantization_param_path=str(tmp_path / "missing.json"))
