"""GGUF checkpoints: each quantisation type read back against ``gguf``'s reference, the
tensors of a converted checkpoint landing in the same parameters as its safetensors original,
and the errors for what we do not load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.gguf_file import find_gguf, gguf_hf_config, gguf_tensors, open_gguf
from radixserve.layers.quantization.gguf import SUPPORTED_GGUF_TYPES, GgufTensor
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_loader_gguf import _llama_qk_row_order
from tests.gguf_checkpoints import convert_checkpoint, llama_cpp_permute
from tests.model_executor.harness import make_runner

gguf = pytest.importorskip("gguf")

# Byte offsets of the fp16 scale fields in one block of each quantised type (ggml-common.h):
# random bytes there could be NaN or inf, so the test writes finite scales at them.
_FP16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
ROWS, COLS = 12, 512


def _random_rows(qtype: str, rng: np.random.Generator) -> np.ndarray:
    """``ROWS`` rows of ``COLS`` values in ``qtype``'s stored form: random blocks (random
    quants, finite random scales), or random floats for the float types."""
    if qtype in ("F32", "F16"):
        return rng.standard_normal((ROWS, COLS)).astype(np.float32 if qtype == "F32" else
                                                         np.float16)
    if qtype == "BF16":
        bits = rng.standard_normal((ROWS, COLS)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(ROWS, 2 * COLS)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (ROWS, COLS // block_values, block_bytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        scales = rng.uniform(-0.1, 0.1, (ROWS, COLS // block_values)).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(ROWS, -1)


def _write_gguf(path, tensors, endianess=gguf.GGUFEndian.LITTLE):
    """A GGUF file (architecture "llama") of ``tensors``: name -> (values, raw_dtype or None)."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    for name, (values, raw_dtype) in tensors.items():
        writer.add_tensor(name, values, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One GGUF file holding a random tensor of every supported type, and those tensors."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    stored = {qtype: _random_rows(qtype, rng) for qtype in SUPPORTED_GGUF_TYPES}
    _write_gguf(path, {
        f"t.{qtype}": (rows, None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype])
        for qtype, rows in stored.items()
    })
    tensors = {t.name: t for t in open_gguf(path).tensors}
    return tensors, stored, path


@pytest.mark.parametrize("qtype", SUPPORTED_GGUF_TYPES)
def test_each_type_dequantises_as_ggufs_reference(typed_file, qtype):
    tensors, stored, _ = typed_file
    reader_tensor = tensors[f"t.{qtype}"]
    assert reader_tensor.tensor_type.name == qtype
    expected = gguf.quants.dequantize(stored[qtype], gguf.GGMLQuantizationType[qtype])
    expected = torch.from_numpy(np.asarray(expected, dtype=np.float32))
    assert expected.shape == (ROWS, COLS) and torch.isfinite(expected).all()
    assert expected.abs().sum() > 0
    tensor = GgufTensor(reader_tensor)
    assert tensor.shape == (ROWS, COLS)
    assert torch.equal(tensor.load(), expected)
    # A rank's rows, and a part of each row, as the tensor-parallel loaders narrow them.
    part = tensor.narrow(0, 4, 6).narrow(1, 256, 128)
    assert part.shape == (6, 128)
    assert torch.equal(part.load(), expected[4:10, 256:384])
    # Rows taken through a permutation, then narrowed.
    order = np.random.default_rng(1).permutation(ROWS)
    permuted = GgufTensor(reader_tensor, order).narrow(0, 2, 5)
    assert torch.equal(permuted.load(), expected[torch.from_numpy(order[2:7])])


def test_the_tensor_table_gives_what_the_reader_gives(typed_file, tmp_path, monkeypatch):
    """``gguf_tensors`` (the cached header table, memory-mapped without a parse) gives every
    tensor as ``GGUFReader`` does: name, type, shape, and the same array of the same bytes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tensors, _, path = typed_file
    for _ in range(2):  # built from a parse, then read from the cache entry
        entries = gguf_tensors(path)
        assert [t.name for t in entries] == list(tensors)
        for entry in entries:
            ref = tensors[entry.name]
            assert entry.tensor_type == ref.tensor_type
            assert entry.shape == tuple(ref.shape.tolist())
            assert entry.data.dtype == ref.data.dtype and entry.data.shape == ref.data.shape
            assert np.array_equal(entry.data.view(np.uint8), ref.data.view(np.uint8))
            assert torch.equal(GgufTensor(entry).load(), GgufTensor(ref).load())
    table_dir = tmp_path / "radixserve" / "gguf" / "tensor-table"
    assert len([p for p in table_dir.iterdir() if p.suffix != ".lock"]) == 1


def test_a_big_endian_files_float_tensors_load_and_its_quantised_ones_are_refused(
        tmp_path, monkeypatch):
    """Big-endian GGUF files (llama.cpp writes them for s390x) hold their floats byte-swapped:
    they load as the values written. Their quantised blocks' scales are big-endian too, which
    ``gguf``'s dequantisation does not read: such a file is refused, naming the tensor."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    values = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    path = _write_gguf(tmp_path / "big.gguf", {"t.F32": (values, None),
                                               "t.F16": (values.astype(np.float16), None)},
                       gguf.GGUFEndian.BIG)
    reader = {t.name: t for t in open_gguf(path).tensors}
    for _ in range(2):
        for entry in gguf_tensors(path):
            assert entry.data.dtype == reader[entry.name].data.dtype  # big-endian floats
            assert np.array_equal(entry.data, reader[entry.name].data)
            expected = values if entry.name == "t.F32" else values.astype(np.float16)
            assert torch.equal(GgufTensor(entry).load(), torch.from_numpy(
                expected.astype(np.float32)))
    blocks = _random_rows("Q8_0", np.random.default_rng(3))
    quantised = _write_gguf(tmp_path / "q.gguf",
                            {"t.Q8_0": (blocks, gguf.GGMLQuantizationType.Q8_0)},
                            gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="t.Q8_0 .* Q8_0 in a big-endian file"):
        gguf_hf_config(quantised)


def test_narrowing_out_of_range_names_the_tensor(typed_file):
    tensors, _, _ = typed_file
    with pytest.raises(ValueError, match="t.Q4_K"):
        GgufTensor(tensors["t.Q4_K"]).narrow(0, 8, 5)


def test_llama_row_order_undoes_llama_cpps_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    stored = llama_cpp_permute(w, heads)
    assert not np.array_equal(stored, w)
    assert np.array_equal(stored[_llama_qk_row_order(heads * head_dim, heads)], w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe",
                                  "qwen3_moe"])
def test_converted_checkpoint_loads_the_same_parameters(arch, checkpoint_factory, tmp_path):
    """Dense and MoE files (the MoE ones with stacked expert tensors, a router, Qwen2-MoE's
    shared expert) fill every parameter as the safetensors original does."""
    hf_dir = checkpoint_factory(arch)
    path = convert_checkpoint(hf_dir, tmp_path / f"{arch}.gguf")
    original = ModelConfig.from_path(hf_dir, dtype="float32")
    config = ModelConfig.from_path(tmp_path, dtype="float32")  # the folder holding it
    assert config.model_path == str(path)
    for name in ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                 "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "tie_word_embeddings", "eos_token_ids", "bos_token_id"):
        assert getattr(config, name) == pytest.approx(getattr(original, name)), name
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size"):
        if key in original.hf_config:
            assert config.hf_config[key] == original.hf_config[key], key
    expected = make_runner(hf_dir).model.state_dict()
    loaded = make_runner(path).model.state_dict()
    assert expected.keys() == loaded.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, loaded[name]), name


def test_q8_0_checkpoint_holds_the_dequantised_weights(checkpoint_factory, tmp_path):
    hf_dir = checkpoint_factory("llama")
    path = convert_checkpoint(hf_dir, tmp_path / "q8.gguf", qtype="Q8_0")
    layer = make_runner(path).model.model.layers[1]
    stored = {t.name: t for t in open_gguf(path).tensors}
    for gguf_name, weight in (("blk.1.ffn_down.weight", layer.mlp.down_proj.weight),
                              ("blk.1.attn_output.weight", layer.self_attn.o_proj.weight)):
        t = stored[gguf_name]
        assert t.tensor_type.name == "Q8_0"
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        assert torch.equal(weight, torch.from_numpy(np.asarray(expected)))


def test_q8_0_moe_checkpoint_reads_each_experts_matrix(checkpoint_factory, tmp_path):
    """A stacked, quantised expert tensor: each expert's parameter holds its own slice."""
    path = convert_checkpoint(checkpoint_factory("qwen3_moe"), tmp_path / "moe.gguf",
                              qtype="Q8_0")
    experts = make_runner(path).model.model.layers[1].mlp.experts
    t = {t.name: t for t in open_gguf(path).tensors}["blk.1.ffn_down_exps.weight"]
    assert t.tensor_type.name == "Q8_0" and t.data.shape[0] == experts.num_experts
    stacked = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type))
    for e in (0, 5, experts.num_experts - 1):
        weight = experts._modules[str(e)].down_proj.weight
        assert torch.equal(weight, torch.from_numpy(stacked[e]))
    assert not torch.equal(experts._modules["0"].down_proj.weight,
                           experts._modules["5"].down_proj.weight)


def test_fused_gate_up_expert_tensors_are_refused_by_name(checkpoint_factory, tmp_path):
    fused = np.zeros((8, 64, 32), np.float32)  # [experts, 2 x moe_intermediate, hidden]
    path = convert_checkpoint(checkpoint_factory("qwen3_moe"), tmp_path / "fused.gguf",
                              extra_tensors={"blk.0.ffn_gate_up_exps.weight": fused})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_up_exps\.weight.*not supported"):
        make_runner(path)


def test_int8_quantisation_of_a_gguf_checkpoint(checkpoint_factory, tmp_path):
    path = convert_checkpoint(checkpoint_factory("qwen3"), tmp_path / "q.gguf", qtype="Q8_0")
    runner = make_runner(path, quantization="int8")
    proj = runner.model.model.layers[0].mlp.down_proj
    assert proj.weight.dtype == torch.int8 and proj.weight_scale.dtype == torch.float32


def _write(path, arch: str, tensors: dict[str, tuple[np.ndarray, str | None]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if raw is None else
                          gguf.GGMLQuantizationType[raw])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_named(tmp_path):
    _write(tmp_path / "m.gguf", "falcon", {"token_embd.weight": (np.zeros((4, 32),
                                                                          np.float32), None)})
    with pytest.raises(ValueError, match="'falcon'.*supported: llama, qwen2, qwen3"):
        ModelConfig.from_path(tmp_path / "m.gguf")


def test_phi3_with_longrope_factors_or_a_partial_rotary_dimension_is_refused(
    checkpoint_factory, tmp_path
):
    hf_dir = checkpoint_factory("phi3")
    factors = np.ones(8, np.float32)
    longrope = convert_checkpoint(hf_dir, tmp_path / "long.gguf", extra_tensors={
        "rope_factors_long.weight": factors, "rope_factors_short.weight": factors})
    with pytest.raises(ValueError, match="LongRoPE factors"):
        gguf_hf_config(longrope)
    partial = convert_checkpoint(hf_dir, tmp_path / "partial.gguf", rope_dims=8)
    with pytest.raises(ValueError, match="rotates 8 of each head's 16 dimensions"):
        gguf_hf_config(partial)


def test_phi3_sliding_window_comes_from_the_metadata(checkpoint_factory, tmp_path):
    import json
    import shutil

    windowed = tmp_path / "windowed"
    shutil.copytree(checkpoint_factory("phi3"), windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    path = convert_checkpoint(windowed, tmp_path / "w.gguf")
    assert gguf_hf_config(path)[0]["sliding_window"] == 8
    assert gguf_hf_config(convert_checkpoint(checkpoint_factory("phi3"), tmp_path / "n.gguf"))[
        0]["sliding_window"] is None


def test_unsupported_quant_type_is_named(tmp_path):
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    data = np.zeros((2, block_bytes), np.uint8)
    _write(tmp_path / "m.gguf", "llama", {"blk.0.attn_q.weight": (data, "IQ2_XXS")})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS"):
        gguf_hf_config(tmp_path / "m.gguf")


def test_folder_with_several_gguf_files_or_a_split_file_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files.*a.gguf, b.gguf"):
        find_gguf(tmp_path)
    split = tmp_path / "m-00001-of-00002.gguf"
    split.write_bytes(b"")
    with pytest.raises(ValueError, match="split GGUF"):
        find_gguf(split)
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # a Hugging Face checkpoint directory


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_path(tmp_path / "m.gguf")
