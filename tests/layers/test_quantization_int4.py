"""4-bit weights (``--quantization int4``): Q4_1's quantisation rule, the file's own Q4_1 blocks
recovered exactly (from ``gguf``'s quantiser and from SmolLM2's GGUF file), and the CPU kernel
against the dequantised float32 reference at odd shapes, both activation dtypes and with bias."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import OpImpl
from radixserve.layers.quantization import resolve_quantization
from radixserve.layers.quantization.int4 import (
    CpuInt4Weight,
    Int4AtLoad,
    Int4Weight,
    dequantize_int4,
    pack_int4,
    quantize_int4,
)
from radixserve.layers.quantization.int8 import dequantize_int8, quantize_int8
from tests.layers.helpers import require_kernels
from tests.layers.test_quantization import assert_close_to_reference


@pytest.mark.parametrize("k", [128, 70])
def test_quantize_int4_takes_each_groups_range_within_half_a_step(k):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, k, generator=gen)
    w[5] = 0.25  # a constant channel: every code 0, the offset its value
    codes, scales, offsets = quantize_int4(w)
    groups = -(-k // 32)
    assert codes.dtype == torch.uint8 and codes.shape == (24, k) and codes.max() <= 15
    assert scales.dtype == offsets.dtype == torch.float16
    assert scales.shape == offsets.shape == (24, groups)
    assert not codes[5].any() and (offsets[5] == 0.25).all() and not scales[5].any()
    # each group's minimum is code 0 and its maximum code 15 (Q4_1's rule)
    assert (codes[:, :32].amin(dim=1) == 0).all() and (codes[:, :32].amax(dim=1)[:5] == 15).all()
    step = scales.float().repeat_interleave(32, dim=1)[:, :k]
    slack = offsets.float().abs().repeat_interleave(32, dim=1)[:, :k] * 2**-10  # fp16 rounding
    assert ((dequantize_int4(codes, scales, offsets) - w).abs() <= step / 2 + 2 * slack).all()


def test_q4_1_blocks_come_back_as_gguf_stored_them():
    """Values ``gguf``'s own Q4_1 quantiser stores, dequantised to float32 (what the loader
    gives), requantise to the very codes, scales and offsets: serving a Q4_1 file at 4 bits
    serves its weights, not a second rounding of them."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    gen = np.random.default_rng(3)
    w = (gen.standard_normal((16, 256)) * 0.05).astype(np.float32)
    stored = quants.quantize(w, GGMLQuantizationType.Q4_1)
    values = torch.from_numpy(np.asarray(quants.dequantize(stored, GGMLQuantizationType.Q4_1)))
    codes, scales, offsets = quantize_int4(values)
    assert torch.equal(dequantize_int4(codes, scales, offsets), values)
    # the block layout: fp16 d, fp16 m, then 16 bytes of codes (low nibbles first)
    blocks = stored.reshape(16, 8, 20)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    assert torch.equal(scales, d) and torch.equal(offsets, m)


def test_smollm2s_q4_1_tensors_come_back_exactly_at_4_bits():
    """The real file: every Q4_1 tensor of a few layers of SmolLM2-135M-Instruct, dequantised
    as the loader does, then quantised by ``--quantization int4``, in float32 and from its
    bf16 rounding (a bf16 model's weights): the file's weights, bit for bit; and its Q8_0 LM
    head in float32."""
    from gguf import GGUFReader

    from radixserve.layers.quantization.gguf import dequantize_rows
    from tests.smollm2 import smollm2_path

    reader = GGUFReader(smollm2_path())
    checked = 0
    for tensor in reader.tensors:
        if tensor.tensor_type.name != "Q4_1" or not tensor.name.startswith(("blk.0.", "blk.29.")):
            continue
        values = torch.from_numpy(dequantize_rows(tensor.data, tensor.tensor_type))
        for loaded in (values, values.bfloat16()):
            assert torch.equal(dequantize_int4(*quantize_int4(loaded)), values), tensor.name
        checked += 1
    assert checked == 14  # q, k, v, output, gate, up, down of two layers
    # the tied LM head (Q8_0): int4's head is int8 with a scale per 32 inputs, Q8_0's block
    head = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert head.tensor_type.name == "Q8_0"
    values = torch.from_numpy(dequantize_rows(head.data, head.tensor_type))
    q, scales = quantize_int8(values, Int4AtLoad().lm_head_group_size())
    assert torch.equal(dequantize_int8(q, scales), values)


def int4_problem(n: int, k: int, m: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(n * 7 + k + m)
    codes, scales, offsets = quantize_int4(torch.randn(n, k, generator=gen) * 0.1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return codes, scales, offsets, x, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, m", [
    (1001, 64, 1), (40, 128, 7), (576, 576, 2), (17, 256, 5), (48, 71, 3), (160, 1536, 13),
    (200, 96, 1), (64, 512, 64),
])
def test_int4_kernel_equals_the_dequantised_reference(dtype, n, k, m):
    require_kernels()
    codes, scales, offsets, x, bias = int4_problem(n, k, m, dtype)
    reference = Int4Weight(codes, scales, offsets).linear(x, bias)
    packed = pack_int4(codes, scales, offsets, OpImpl.CPU)
    assert isinstance(packed, CpuInt4Weight)
    out = packed.linear_vnni(x, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to_reference(out, reference)
    assert torch.equal(packed.linear_vnni(x[:1], bias), out[:1])  # batch invariant
    assert_close_to_reference(packed.linear_dequant(x, bias), reference)
    assert_close_to_reference(packed.linear(x, None), Int4Weight(codes, scales, offsets).linear(
        x, None))
    assert pack_int4(codes, scales, offsets, OpImpl.NATIVE).linear(x, bias).equal(reference)


def test_int4_kernel_rejects_bad_input_with_a_clear_error():
    require_kernels()
    codes, scales, offsets = quantize_int4(torch.randn(40, 64))
    blocked, d, m = cpu_kernels.pack_int4_weight(codes, scales, offsets)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    op = torch.ops.radixserve_cpu.linear_int4
    with pytest.raises(RuntimeError, match="takes bfloat16 or float32 activations, got Half"):
        op(x.half(), blocked, d, m, None, 40)
    with pytest.raises(RuntimeError, match=r"codes must be uint8 \[N/16, K/4, 32\]"):
        op(x, blocked.to(torch.int8), d, m, None, 40)
    with pytest.raises(RuntimeError, match="K within the weight's 64 inputs"):
        op(torch.zeros(2, 16, dtype=torch.bfloat16), blocked, d, m, None, 40)
    with pytest.raises(RuntimeError, match="scales and offsets must be fp16"):
        op(x, blocked, d.float(), m, None, 40)
    with pytest.raises(RuntimeError, match="n = 50 does not fit"):
        op(x, blocked, d, m, None, 50)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[40\]"):
        op(x, blocked, d, m, torch.zeros(40), 40)


def test_int4_comes_from_the_flag_and_refuses_what_fp16_cannot_hold():
    assert isinstance(resolve_quantization("int4", {}), Int4AtLoad)
    assert Int4AtLoad().quantizes_lm_head()
    with pytest.raises(ValueError, match="finite weights within fp16's range"):
        quantize_int4(torch.tensor([[1e6] * 32]))
