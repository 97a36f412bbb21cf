"""Every ``CustomOp`` picks its implementation once, when it is built, from the build context's
device and dtype; and on random shapes, in bf16 and float32, its CPU implementation returns what
its native torch reference returns (bit for bit, or up to the ties its docstring states: a bf16
value on the other side of a rounding, a float32 value an ulp or two away)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.layers.activation import SiluAndMul
from radixserve.layers.custom_op import OpImpl, build_context
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import ApplyRotaryEmbedding, RotaryEmbedding
from radixserve.layers.sampler import GreedyArgmax
from tests.layers.helpers import (
    assert_bf16_equal_but_for_ties,
    bf16_inputs,
    ops_here,
    require_ops,
)

OPS = {
    "rms_norm": lambda: RMSNorm(8),
    "silu_and_mul": SiluAndMul,
    "rotary": ApplyRotaryEmbedding,
    "argmax": GreedyArgmax,
}
# random shapes: (seed, rows, width)
SHAPES = [(seed, random.Random(seed).randint(1, 70), random.Random(-seed).randint(1, 5000))
          for seed in range(8)]


def build(make, dtype: torch.dtype, device: str = "cpu"):
    with build_context(device, dtype):
        return make()


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_op_takes_the_cpu_kernels_where_they_load_for_the_models_dtype(name, dtype):
    op = build(OPS[name], dtype)
    expected = OpImpl.CPU if ops_here(name) and dtype in op.cpu_dtypes else OpImpl.NATIVE
    assert op.impl is expected
    # bound once: a call goes straight to the chosen implementation
    assert op._forward == (op.forward_cpu if expected is OpImpl.CPU else op.forward_native)
    assert build(OPS[name], dtype, "meta").impl is OpImpl.NATIVE  # no kernels for that device


def cpu_op(kernel: str, make, dtype: torch.dtype = torch.bfloat16):
    """The op built for ``dtype`` on CPU (the test skips where its kernel does not run)."""
    require_ops(kernel)
    op = build(make, dtype)
    assert op.impl is OpImpl.CPU
    return op


def equal_but_for_ties(actual: torch.Tensor, expected: torch.Tensor, steps: int = 1) -> None:
    if actual.dtype == torch.bfloat16:
        assert_bf16_equal_but_for_ties(actual, expected, steps)
    else:  # float32: torch's reductions and exp sum in another order, off by an ulp or two
        torch.testing.assert_close(actual, expected, rtol=3e-7 * steps, atol=1e-30)


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed, rows, hidden", SHAPES)
def test_rms_norm_cpu_equals_native_but_for_ties(seed, rows, hidden, dtype):
    op = cpu_op("rms_norm", lambda: RMSNorm(hidden), dtype)
    x, residual, weight = (t.to(dtype) for t in bf16_inputs(rows, hidden, seed=seed))
    op.weight.data = weight
    equal_but_for_ties(op.forward_cpu(x), op.forward_native(x), steps=2)
    # with a residual: the sum is torch's bf16 add exactly, its norm as above; the CPU version
    # writes both into the tensors it was given
    normed, total = op.forward_native(x, residual)
    x2, residual2 = x.clone(), residual.clone()
    cpu_normed, cpu_total = op.forward_cpu(x2, residual2)
    assert cpu_normed.data_ptr() == x2.data_ptr() and cpu_total.data_ptr() == residual2.data_ptr()
    assert torch.equal(cpu_total, total)
    equal_but_for_ties(cpu_normed, normed, steps=2)


def test_rms_norm_cpu_takes_views_out_of_place():
    op = cpu_op("rms_norm", lambda: RMSNorm(64))
    # Qwen3's per-head q of a fused qkv row, and a residual view: neither is contiguous
    qkv, residual, weight = bf16_inputs(3, 4 * 64 + 2 * 64, seed=1)
    op.weight.data = weight[:64]
    q = qkv[:, : 4 * 64].reshape(3, 4, 64)
    assert_bf16_equal_but_for_ties(op.forward_cpu(q), op.forward_native(q), steps=2)
    x, r = qkv[:, :64], residual[:, 64:128]
    before = qkv.clone(), residual.clone()
    normed, total = op.forward_cpu(x, r)
    assert torch.equal(qkv, before[0]) and torch.equal(residual, before[1])
    native_normed, native_total = op.forward_native(x, r)
    assert torch.equal(total, native_total)
    assert_bf16_equal_but_for_ties(normed, native_normed, steps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed, rows, d", SHAPES)
def test_silu_and_mul_cpu_equals_native_but_for_ties(seed, rows, d, dtype):
    op = cpu_op("silu_and_mul", SiluAndMul, dtype)
    x = bf16_inputs(rows, 2 * d, seed=seed)[0].to(dtype)
    equal_but_for_ties(op.forward_cpu(x), op.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_rotary_cpu_equals_native_bit_for_bit(seed, dtype):
    op = cpu_op("rotary", ApplyRotaryEmbedding, dtype)
    rng = random.Random(seed)
    tokens, heads, head_dim = rng.randint(1, 40), rng.randint(1, 20), 2 * rng.randint(1, 128)
    gen = torch.Generator().manual_seed(seed)
    cos, sin = RotaryEmbedding(head_dim, 4096, 10000.0)(
        torch.randint(0, 4096, (tokens,), generator=gen), dtype
    )
    # q and k heads as a row-strided view of a wider qkv row, as the model passes them
    qkv = (4 * torch.randn(tokens, (heads + 1) * head_dim, generator=gen)).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    out = op.forward_cpu(x, cos, sin)
    assert out.is_contiguous()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.view(bits), op.forward_native(x, cos, sin).view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed, rows, vocab", SHAPES)
def test_argmax_cpu_equals_native_with_ties_nan_and_banned_rows(seed, rows, vocab, dtype):
    op = cpu_op("argmax", GreedyArgmax)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows + 4, vocab, generator=gen).to(dtype)
    logits[0, [0, vocab - 1]] = 100.0  # a tie: the first maximum wins
    logits[1] = float("-inf")  # every token banned
    logits[2, [vocab // 2, vocab - 1]] = float("nan")  # NaN counts as the maximum
    logits[3] = torch.round(logits[3])  # many ties
    expected = logits.argmax(dim=-1)
    assert torch.equal(op.forward_native(logits), expected)
    assert torch.equal(op.forward_cpu(logits), expected)
    assert torch.equal(op.forward_cpu(logits.T.contiguous().T), expected)  # not contiguous
