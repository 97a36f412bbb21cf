"""The Triton kernels behind the ops' ``forward_cuda`` (RMSNorm, add+RMSNorm, rotary,
SiLU-and-mul), run by Triton's interpreter on CPU against each op's ``forward_native`` on random
shapes, in fp32 and fp16 (the interpreter computes bf16 wrongly; the GPU check covers it); and the
ops pick them only when built for CUDA."""

from __future__ import annotations

import os

import torch

# Only where no GPU runs the compiled kernels: the variable stays set for the whole test session
# (and the servers it starts), which on a GPU machine would interpret tests/cuda's kernels too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

from radixserve.layers.activation import SiluAndMul  # noqa: E402
from radixserve.layers.custom_op import OpImpl, build_context  # noqa: E402
from radixserve.layers.layernorm import RMSNorm  # noqa: E402
from radixserve.layers.rotary_embedding import (  # noqa: E402
    ApplyRotaryEmbedding,
    RotaryEmbedding,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
DTYPES = [torch.float32, torch.float16]
# fp32: float32 sums in another order; fp16: one rounding step either side.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}


def _native(make, dtype):
    with build_context("cpu", dtype):
        op = make()
    return op


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rms_norm_and_fused_add(seed, dtype):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, hidden = rng.randint(1, 9), rng.choice([64, 96, 200])
    norm = _native(lambda: RMSNorm(hidden, eps=1e-6), dtype)
    norm.weight.copy_(_rand(gen, hidden, dtype=dtype))
    x = _rand(gen, rows, hidden, dtype=dtype) * 3
    residual = _rand(gen, rows, hidden, dtype=dtype)
    torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x), **TOL[dtype])

    expected, expected_sum = norm.forward_native(x, residual)
    out, new_residual = norm.forward_cuda(x.clone(), residual.clone())
    assert torch.equal(new_residual, expected_sum)  # one rounding of one add: exact
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_rows(dtype):
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, head_dim = 5, 4, 2, 64
    rope = RotaryEmbedding(head_dim, 128, 10000.0)
    cos, sin = rope(torch.tensor([0, 7, 3, 100, 31]), dtype)
    op = _native(ApplyRotaryEmbedding, dtype)
    # q as the models pass it: a view of the fused qkv output, rows strided.
    qkv = _rand(gen, n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    assert not q.is_contiguous()
    out = op.forward_cuda(q, cos, sin)
    assert out.is_contiguous()
    torch.testing.assert_close(out, op.forward_native(q, cos, sin), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 64), (2, 4, 2 * 344), (1, 2 * 2048)])
def test_silu_and_mul(shape, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    op = _native(SiluAndMul, dtype)
    x = _rand(gen, *shape, dtype=dtype) * 4
    torch.testing.assert_close(op.forward_cuda(x), op.forward_native(x), **TOL[dtype])


@pytest.mark.parametrize("make", [lambda: RMSNorm(8), SiluAndMul, ApplyRotaryEmbedding])
def test_cuda_kernels_are_chosen_only_for_cuda(make, monkeypatch):
    """``select_impl`` gives CUDA only when the build context's device is CUDA: on CPU and meta
    the ops never bind ``forward_cuda``."""
    for device in ("cpu", "meta"):
        with build_context(device, torch.float16):
            op = make()
        assert op.impl is not OpImpl.CUDA and op._forward != op.forward_cuda
    # A CUDA build context binds forward_cuda (the device is faked: no tensors are made).
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda"))
    from radixserve.layers.custom_op import select_impl

    assert select_impl((), ()) is OpImpl.CUDA
