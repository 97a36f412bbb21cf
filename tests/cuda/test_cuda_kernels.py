"""The Triton kernels compiled for the GPU: paged attention against ``torch_native`` (fp32, fp16
and bf16, which the CPU interpreter cannot check; head_dim 64 to 256; longer sequences and larger
batches than the interpreter tests), and the fused ops against ``forward_native``."""

from __future__ import annotations

import pytest
import torch

from radixserve.forward_batch import ForwardMode
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.custom_op import OpImpl, build_context
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import ApplyRotaryEmbedding, RotaryEmbedding
from tests.cuda.helpers import DEVICE, ON_CUDA, requires_device
from tests.layers.paged_batches import attend, random_batch

pytestmark = requires_device
# fp32: IEEE dots, other summation orders; fp16/bf16: the probabilities are rounded to the
# activation dtype before the PV product, as in every flash kernel.
ATTN_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
OP_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page_size"),
                         [(8, 2, 64, 1), (14, 2, 64, 16), (32, 8, 128, 16), (4, 1, 256, 4),
                          (8, 4, 80, 1)])
def test_triton_attention_matches_torch_native(mode, dtype, heads, kv_heads, head_dim, page_size):
    shape = (heads, kv_heads, head_dim)
    for seed in range(3):
        batch = random_batch(seed, mode, page_size, dtype, *shape, max_extend=150,
                             max_prefix=300, max_bs=8, device=DEVICE)
        out = attend("triton", batch)
        expected = attend("torch_native", batch)
        assert not out.isnan().any()
        tol = ATTN_TOL[dtype]
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.skipif(not ON_CUDA, reason="the kernels are compiled only on CUDA")
def test_kernels_are_compiled_not_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    from radixserve.layers import triton_ops
    from radixserve.layers.attention import triton_kernels

    assert not isinstance(triton_kernels._decode_stage1, InterpretedFunction)
    assert not isinstance(triton_ops._rms_norm_kernel, InterpretedFunction)
    from radixserve.layers import triton_sampling

    assert not isinstance(triton_sampling._argmax_kernel, InterpretedFunction)


def _op(make, dtype):
    with build_context(DEVICE, dtype):
        op = make()
    if ON_CUDA:
        assert op.impl is OpImpl.CUDA
    return op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [896, 4096])
def test_fused_ops_match_native(dtype, hidden):
    gen = torch.Generator(device=DEVICE).manual_seed(hidden)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    norm = _op(lambda: RMSNorm(hidden), dtype)
    norm.weight.copy_(rand(hidden))
    x, residual = rand(37, hidden) * 3, rand(37, hidden)
    tol = OP_TOL[dtype]
    torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x), **tol_kw(tol))
    expected, expected_sum = norm.forward_native(x, residual)
    out, new_sum = norm.forward_cuda(x.clone(), residual.clone())
    assert torch.equal(new_sum, expected_sum)
    torch.testing.assert_close(out, expected, **tol_kw(tol))

    act = _op(SiluAndMul, dtype)
    gate_up = rand(37, 2 * hidden) * 4
    torch.testing.assert_close(act.forward_cuda(gate_up), act.forward_native(gate_up),
                               **tol_kw(tol))

    heads, head_dim = 8, 128
    rope = RotaryEmbedding(head_dim, 4096, 500000.0).to(DEVICE)
    positions = torch.randint(0, 4096, (37,), generator=gen, device=DEVICE)
    cos, sin = rope(positions, dtype)
    qkv = rand(37, (heads + 4) * head_dim)
    q = qkv[:, : heads * head_dim].view(37, heads, head_dim)
    rot = _op(ApplyRotaryEmbedding, dtype)
    torch.testing.assert_close(rot.forward_cuda(q, cos, sin), rot.forward_native(q, cos, sin),
                               **tol_kw(tol))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_kernels_match_native(dtype):
    """The sampler's argmax and temperature/min_p kernels over a real vocabulary size (bf16
    logits are what the greedy path reads on a GPU): the argmax exactly; sampled tokens equal
    the float64 reference's but for targets within float32 rounding of a boundary."""
    from radixserve.layers.sampler import GreedyArgmax, TemperatureSample

    gen = torch.Generator(device=DEVICE).manual_seed(7)
    logits = (torch.randn(64, 151936, generator=gen, device=DEVICE) * 4).to(dtype)
    logits[3, 100] = logits[3, 150000] = logits[3].max() + 1  # a tie across blocks
    argmax = _op(GreedyArgmax, dtype)
    assert torch.equal(argmax.forward_cuda(logits), logits.argmax(dim=-1))
    sample = _op(TemperatureSample, dtype)
    temps = torch.rand(64, 1, generator=gen, device=DEVICE) + 0.2
    min_ps = torch.rand(64, generator=gen, device=DEVICE) * 0.1
    uniforms = torch.rand(64, 1, generator=gen, device=DEVICE, dtype=torch.float64)
    floats = logits.float()
    got = sample.forward_cuda(floats, temps, min_ps, uniforms)
    want = sample.forward_native(floats, temps, min_ps, uniforms)
    assert int((got != want).sum()) <= 2


def tol_kw(tol: float) -> dict[str, float]:
    return {"atol": tol, "rtol": tol}


@pytest.mark.skipif(not ON_CUDA, reason="the pinned copy is CUDA's")
def test_sample_output_copies_to_pinned_memory_behind_the_step():
    from radixserve.layers.sampler import SampleOutput

    ids = torch.randint(0, 151936, (64,), device=DEVICE)
    logprobs = -torch.rand(64, device=DEVICE)
    out = SampleOutput(ids, logprobs)
    out.start_host_copy()
    assert out._host is not None and out._host.is_pinned()
    assert out.to_host() == (ids.tolist(), logprobs.tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_kernels_match_native(dtype):
    """The batched LoRA delta's shrink/expand kernels at a real model's width (bf16 is what the
    interpreter tests cannot check)."""
    from radixserve.layers.lora import LoRABatchInfo, LoRADelta

    gen = torch.Generator(device=DEVICE).manual_seed(3)
    slots = [0] * 40 + [-1] * 7 + [3] * 33 + [1, 2, -1, 1, 0, 3]
    x = torch.randn(len(slots), 896, generator=gen, device=DEVICE).to(dtype)
    a = (torch.randn(4, 16, 896, generator=gen, device=DEVICE) / 30).to(dtype)
    b = torch.randn(4, 4864, 16, generator=gen, device=DEVICE).to(dtype)
    info = LoRABatchInfo.from_token_slots(torch.tensor(slots), DEVICE)
    op = _op(LoRADelta, dtype)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(op.forward_cuda(x, a, b, info).float(),
                               op.forward_native(x, a, b, info).float(), atol=tol, rtol=tol)
