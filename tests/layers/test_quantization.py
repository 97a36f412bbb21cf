"""Int8 weights: the symmetric quantisation, the CPU kernel against the dequantised float32
reference (per channel and per group, bf16 and float32 activations, odd shapes), the
compressed-tensors packing read back exactly as the reference library writes it, and the
quantisation a model gets from ``--quantization`` and its checkpoint's config."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import OpImpl
from radixserve.layers.quantization import resolve_quantization
from radixserve.layers.quantization.compressed_tensors import CompressedTensorsW8A16, unpack_int8
from radixserve.layers.quantization.int8 import (
    CpuInt8Weight,
    Int8AtLoad,
    Int8Weight,
    dequantize_int8,
    pack_int8,
    quantize_int8,
)
from tests.layers.helpers import require_ops


@pytest.mark.parametrize("group_size", [None, 32])
def test_quantize_int8_is_symmetric_and_within_half_a_step(group_size):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)
    w[3] = 0.0  # an all-zero channel stays zero
    q, scales = quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scales.shape == (48, 128 // group_size if group_size else 1)
    assert q.abs().max() == 127 and not q[3].any()
    step = scales.repeat_interleave(128 // scales.shape[1], dim=1)
    assert ((dequantize_int8(q, scales) - w).abs() <= step / 2 + 1e-7).all()


def int8_problem(n: int, k: int, m: int, group_size: int | None, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(n * 7 + k + m)
    q, scales = quantize_int8(torch.randn(n, k, generator=gen), group_size)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return q, scales, x, bias


def assert_close_to_reference(out: torch.Tensor, reference: torch.Tensor) -> None:
    """The kernel quantises activations per row to int16 (an error of at most max |x| / 65534
    per value) and rounds once; bf16 outputs round to 8 bits."""
    scale = reference.abs().max().item()
    tol = 2**-7 if out.dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.double(), reference.double(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, m, group_size", [
    (1001, 64, 1, None), (40, 128, 7, 32), (896, 896, 2, None), (17, 256, 5, 128),
    (48, 71, 3, None), (160, 4864, 13, None), (64, 512, 64, 256),
])
def test_int8_kernel_equals_the_dequantised_reference(dtype, n, k, m, group_size):
    require_ops("linear_int8")
    q, scales, x, bias = int8_problem(n, k, m, group_size, dtype)
    reference = Int8Weight(q, scales).linear(x, bias)
    packed = pack_int8(q, scales, OpImpl.CPU)
    assert isinstance(packed, CpuInt8Weight)
    out = packed.linear(x, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to_reference(out, reference)
    assert torch.equal(packed.linear(x[:1], bias), out[:1])  # batch invariant
    assert pack_int8(q, scales, OpImpl.NATIVE).linear(x, bias).equal(reference)


def test_int8_kernel_rejects_bad_input_with_a_clear_error():
    require_ops("linear_int8")
    q, scales = quantize_int8(torch.randn(40, 64))
    weight, blocked_scales = cpu_kernels.pack_int8_weight(q, scales)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    op = torch.ops.radixserve_cpu.linear_int8
    with pytest.raises(RuntimeError, match="takes bfloat16 or float32 activations, got Half"):
        op(x.half(), weight, blocked_scales, None, 40)
    with pytest.raises(RuntimeError, match="the weight must be int8 blocked"):
        op(x, weight.float(), blocked_scales, None, 40)
    with pytest.raises(RuntimeError, match=r"K = 64 \(or one less\)"):
        op(torch.zeros(2, 60, dtype=torch.bfloat16), weight, blocked_scales, None, 40)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        op(x, weight, blocked_scales.half(), None, 40)
    with pytest.raises(RuntimeError, match="n = 50 does not fit"):
        op(x, weight, blocked_scales, None, 50)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[40\]"):
        op(x, weight, blocked_scales, torch.zeros(40), 40)


def test_unpack_reads_what_compressed_tensors_packs():
    pack_to_int32 = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers"
    ).pack_to_int32
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (24, 70), generator=gen, dtype=torch.int32).to(torch.int8)
    packed = pack_to_int32(q, 8)
    assert packed.dtype == torch.int32 and packed.shape == (24, 18)
    assert torch.equal(unpack_int8(packed, 70), q)
    with pytest.raises(ValueError, match="holds 72 values per row, the layer takes 80"):
        unpack_int8(packed, 80)


W8A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False,
                    "strategy": "channel", "group_size": None},
    }},
}


def w8a16(**weights: object) -> dict:
    config = {**W8A16, "config_groups": {"group_0": dict(W8A16["config_groups"]["group_0"])}}
    group = config["config_groups"]["group_0"]
    group["weights"] = {**group["weights"], **weights}
    return config


def test_quantization_comes_from_the_flag_or_the_checkpoint():
    assert resolve_quantization(None, {}) is None
    assert isinstance(resolve_quantization("int8", {}), Int8AtLoad)
    channel = resolve_quantization(None, {"quantization_config": W8A16})
    assert isinstance(channel, CompressedTensorsW8A16) and channel.group_size is None
    assert not channel.quantizes_lm_head()
    grouped = resolve_quantization("int8", {"quantization_config": w8a16(strategy="group",
                                                                         group_size=128)})
    assert grouped.group_size == 128  # the checkpoint's int8 scheme; the flag agrees


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 4}, "checkpoint quantization 'gptq' is not supported"),
    (w8a16(num_bits=4), "weights num_bits=4"),
    (w8a16(symmetric=False), "weights symmetric=False"),
    (w8a16(strategy="tensor"), "weights strategy 'tensor'"),
    (w8a16(strategy="group", group_size=None), "group_size None"),
    ({**W8A16, "format": "int-quantized", "config_groups": {"g": {
        **W8A16["config_groups"]["group_0"], "format": "int-quantized"}}},
     "format 'int-quantized'"),
    ({**W8A16, "config_groups": {"g": {**W8A16["config_groups"]["group_0"],
                                       "input_activations": {"num_bits": 8}}}},
     "activations are quantised"),
    ({**W8A16, "ignore": []}, r"ignore \[\]"),
])
def test_checkpoint_quantization_other_than_w8a16_is_refused_naming_why(config, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, {"quantization_config": config})


def test_an_unknown_quantization_flag_is_refused():
    with pytest.raises(ValueError,
                       match=r"quantization must be one of \('int8', 'int4'\), got 'fp8'"):
        resolve_quantization("fp8", {})
