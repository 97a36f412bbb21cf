"""The Triton kernels behind the sampler's CUDA path (greedy argmax, temperature/min_p sampling),
run by Triton's interpreter on CPU against the ops' ``forward_native``, in fp32 and fp16 (the
interpreter computes bf16 wrongly; the GPU check covers it)."""

from __future__ import annotations

import os

import torch

# Only where no GPU runs the compiled kernels (see test_triton_ops.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from radixserve.layers.custom_op import build_context  # noqa: E402
from radixserve.layers.sampler import GreedyArgmax, TemperatureSample  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


def _op(make):
    with build_context("cpu", torch.float32):
        return make()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 2500])
def test_argmax_matches_torch_with_ties_infinities_and_nan(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen).to(dtype)
    if vocab > 1:
        # ties: the first maximum wins, also across the kernel's 1024-wide blocks
        logits[1, :] = 0
        logits[1, vocab // 2] = logits[1, vocab - 1] = 5
        logits[2, :] = -float("inf")  # all -inf: index 0
        logits[3, vocab - 1] = float("nan")  # NaN counts as the maximum
        logits[4, vocab // 3] = float("inf")
        logits[4, vocab - 1] = float("nan")  # NaN beats an earlier +inf, as in torch
        logits[5, 0] = logits[5, vocab - 1] = float("nan")  # the first NaN
    op = _op(GreedyArgmax)
    expected = logits.argmax(dim=-1)
    assert torch.equal(op.forward_cuda(logits), expected)
    assert torch.equal(op.forward_native(logits), expected)
    # rows of a strided view (the sampler's logits may be a slice)
    wide = torch.randn(4, vocab + 5, generator=gen).to(dtype)[:, :vocab]
    assert torch.equal(op.forward_cuda(wide), wide.argmax(dim=-1))


def _cdf(logits, temperatures, min_ps):
    probs = torch.softmax(logits.double() / temperatures.double(), dim=-1)
    if min_ps is not None:
        threshold = probs.amax(-1, keepdim=True) * min_ps.double()[:, None]
        probs = probs.masked_fill(probs < threshold, 0)
    return probs.cumsum(-1)


@pytest.mark.parametrize("with_min_p", [False, True])
@pytest.mark.parametrize("vocab", [5, 300, 2100])
def test_temperature_sample_inverts_the_cdf(with_min_p, vocab):
    """Each row's token is the one whose cumulative interval holds ``uniform * mass``: the same
    token as the float64 reference, except where the target lies within float32 rounding of a
    boundary (then either neighbour is right)."""
    gen = torch.Generator().manual_seed(vocab + with_min_p)
    bs = 64
    logits = torch.randn(bs, vocab, generator=gen) * 3
    logits[0, : vocab // 2] = -float("inf")  # a grammar-masked row: those never drawn
    temperatures = torch.rand(bs, 1, generator=gen) * 1.5 + 0.1
    min_ps = torch.rand(bs, generator=gen) * 0.3 if with_min_p else None
    uniforms = torch.rand(bs, 1, generator=gen, dtype=torch.float64)
    uniforms[1, 0] = 0.0
    uniforms[2, 0] = 1.0 - 2**-53  # rounds up to the whole mass: the last token with mass
    op = _op(TemperatureSample)
    got = op.forward_cuda(logits, temperatures, min_ps, uniforms)
    want = op.forward_native(logits, temperatures, min_ps, uniforms)
    cdf = _cdf(logits, temperatures, min_ps)
    mass = torch.diff(cdf, dim=-1, prepend=torch.zeros(bs, 1, dtype=torch.float64))
    assert bool((mass[torch.arange(bs), got] > 0).all()), "drew a token without mass"
    assert int(got[0]) >= vocab // 2
    differ = (got != want).nonzero().flatten().tolist()
    for row in differ:
        target = float(uniforms[row, 0]) * float(cdf[row, -1])
        boundary = float(cdf[row, min(int(got[row]), int(want[row]))])
        assert abs(target - boundary) < 1e-5, (row, int(got[row]), int(want[row]))
    assert len(differ) <= 2, differ

