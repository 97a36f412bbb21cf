"""radixserve's CPU kernels, built where the CPU has AVX512-BF16, against float64 references.

The small-batch bf16 linear kernels equal a float64 reference up to bf16 rounding. The fused
RMSNorm, add + RMSNorm and SiluAndMul equal float64 references that round to bf16 where
transformers' bf16 modules do. The decode attention kernel writes the new K/V and equals a
float64 attention. Bad input gets a clear error. (The ops and packed weights that call them are
tested against their native references in ``test_custom_ops.py`` and ``test_packed_weight.py``.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers.cpu_kernels import (
    AMX_MAX_ROWS,
    BlockedWeight,
    attention_kernels_support,
    decode_attention,
    fused_add_rms_norm,
    gemv,
    load_cpu_kernels,
    rms_norm,
    rotary,
    silu_and_mul,
    small_gemm_amx,
)
from radixserve.layers.rotary_embedding import RotaryEmbedding
from tests.layers.helpers import (
    HAS_AMX,
    assert_bf16_equal_but_for_ties,
    bf16_close,
    bf16_inputs,
    kernels_here,
)
from tests.layers.helpers import HAS_KERNELS as HAS_BF16


def random_problem(n: int, k: int, m: int, bias: bool):
    gen = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    reference = x.double() @ w.double().T + (b.double() if bias else 0)
    return w, x, b, reference


def test_kernels_build_exactly_where_the_cpu_supports_them():
    assert load_cpu_kernels() == HAS_BF16
    blocked = BlockedWeight.of(torch.zeros(32, 64, dtype=torch.bfloat16))
    if not HAS_BF16:
        assert blocked is None
        return
    assert blocked is not None and blocked.amx == HAS_AMX
    assert blocked.max_rows == (AMX_MAX_ROWS if HAS_AMX else 1)


def load_in_a_fresh_process(cache: Path) -> None:
    script = "from radixserve.layers.cpu_kernels import load_cpu_kernels as f; print(f())"
    # the timeout only turns a regression (a load waiting forever) into a failure
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)}, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stderr


@pytest.mark.skipif(not HAS_BF16, reason="the kernels are not built on this CPU")
def test_what_a_killed_build_leaves_blocks_no_later_load_or_build(tmp_path):
    """A build killed mid-compile leaves cpp_extension's baton file and a scratch directory;
    neither may make a later start wait, with the library cached or still to build."""
    from radixserve.layers import cpu_kernels

    assert load_cpu_kernels()
    built = cpu_kernels._build_dir(cpu_kernels._cpu_flags())
    cached, fresh = tmp_path / "cached", tmp_path / "fresh"
    for cache in (cached, fresh):
        kernels = cache / built.parent.relative_to(built.parents[2])
        kernels.mkdir(parents=True)
        if cache is cached:
            shutil.copytree(built, kernels / built.name)
            (kernels / built.name / "lock").touch()
        (kernels / f"{built.name}.build-killed").mkdir()
        (kernels / f"{built.name}.build-killed" / "lock").touch()
        load_in_a_fresh_process(cache)
        assert sorted(p.name for p in kernels.iterdir()) == [built.name, f"{built.name}.lock"]
        assert (kernels / built.name / f"{cpu_kernels.LIBRARY_NAME}.so").exists()


def test_blocked_copy_is_refused_for_weights_the_kernels_cannot_take():
    assert BlockedWeight.of(torch.zeros(32, 64)) is None  # float32
    assert BlockedWeight.of(torch.zeros(40, 64, dtype=torch.bfloat16)) is None  # N % 16
    odd_k = BlockedWeight.of(torch.zeros(32, 70, dtype=torch.bfloat16))  # K % 32: GEMV only
    assert odd_k is None if not HAS_BF16 else (odd_k.max_rows == 1 and not odd_k.amx)


@pytest.mark.parametrize("n, k, bias", [(48, 70, True), (1152, 896, True), (896, 4864, False)])
def test_gemv_equals_a_float64_reference_up_to_bf16_rounding(n, k, bias):
    if not HAS_BF16:
        assert not load_cpu_kernels()  # nothing to run here: layers use oneDNN
        return
    w, x, b, reference = random_problem(n, k, 1, bias)
    out = gemv(x, BlockedWeight.of(w).packed, b)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    bf16_close(out, reference)


# rows: one, a part of a tile, a whole tile, one past it, two tiles; blocks of 16 outputs: whole
# passes of four (or two) and the odd ones after them
@pytest.mark.parametrize("n, k, m, bias", [
    (80, 128, 1, True), (80, 128, 5, False), (48, 64, 16, True), (80, 128, 17, True),
    (112, 96, 31, False), (48, 4864, 32, False), (1152, 896, 24, True),
])
def test_amx_kernel_equals_a_float64_reference_up_to_bf16_rounding(n, k, m, bias):
    w, x, b, reference = random_problem(n, k, m, bias)
    blocked = BlockedWeight.of(w)
    if not HAS_AMX:
        assert blocked is None or not blocked.amx  # layers use the GEMV or oneDNN here
        return
    out = small_gemm_amx(x, blocked.packed, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    bf16_close(out, reference)


def test_amx_kernel_rejects_what_it_cannot_compute_with_a_clear_error():
    blocked = BlockedWeight.of(torch.randn(32, 64).to(torch.bfloat16))
    if not HAS_AMX:
        assert blocked is None or not blocked.amx  # no layer calls the AMX kernel here
        return
    packed = blocked.packed
    with pytest.raises(RuntimeError, match="1 <= M <= 32"):
        small_gemm_amx(torch.zeros(33, 64, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        small_gemm_amx(torch.zeros(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="features"):
        small_gemm_amx(torch.zeros(2, 96, dtype=torch.bfloat16), packed, None)
    odd_k = BlockedWeight.of(torch.zeros(32, 70, dtype=torch.bfloat16)).packed
    with pytest.raises(RuntimeError, match="multiple of 32"):
        small_gemm_amx(torch.zeros(2, 70, dtype=torch.bfloat16), odd_k, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        small_gemm_amx(torch.zeros(2, 64, dtype=torch.bfloat16), packed,
                       torch.zeros(31, dtype=torch.bfloat16))


EPS = 1e-6
SHAPES = [(rows, hidden) for rows in (1, 3, 64) for hidden in (70, 896, 4864)]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' bf16 RMSNorm in float64: the normalised value is rounded to bf16 before the
    weight multiplies it, and the product again."""
    h = x.double()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    return (weight.double() * h.double()).to(torch.bfloat16)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """torch's bf16 ``F.silu(gate) * up`` in float64: silu rounded to bf16, then the product."""
    gate, up = x.double().chunk(2, dim=-1)
    silu = (gate / (1 + torch.exp(-gate))).to(torch.bfloat16)
    return (silu.double() * up).to(torch.bfloat16)


@pytest.mark.parametrize("rows, hidden", SHAPES)
def test_rms_norm_kernel_equals_a_float64_reference_with_transformers_roundings(rows, hidden):
    if not kernels_here():
        return
    x, _, weight = bf16_inputs(rows, hidden, seed=rows * hidden)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_bf16_equal_but_for_ties(out, rms_norm_reference(x, weight), steps=2)


@pytest.mark.parametrize("rows, hidden", SHAPES)
def test_fused_add_rms_norm_stores_torchs_bf16_sum_and_its_norm_in_place(rows, hidden):
    if not kernels_here():
        return
    x, residual, weight = bf16_inputs(rows, hidden, seed=rows + hidden)
    total = x + residual  # torch's bf16 add: the unfused decoder's residual stream
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    fused_add_rms_norm(x, residual, weight, EPS)
    assert x.data_ptr() == x_ptr and residual.data_ptr() == residual_ptr
    assert torch.equal(residual, total)
    assert_bf16_equal_but_for_ties(x, rms_norm_reference(total, weight), steps=2)


@pytest.mark.parametrize("rows, d", SHAPES)
def test_silu_and_mul_kernel_equals_a_float64_reference_with_torchs_roundings(rows, d):
    if not kernels_here():
        return
    x, _, _ = bf16_inputs(rows, 2 * d, seed=rows * d + 1)
    out = silu_and_mul(x)
    assert out.shape == (rows, d) and out.dtype == torch.bfloat16
    assert_bf16_equal_but_for_ties(out, silu_and_mul_reference(x))


def test_silu_and_mul_kernel_agrees_with_torch_on_every_bf16_gate():
    if not kernels_here():
        return
    # all 65536 bit patterns: the kernel's exp over the whole range, overflow, inf and NaN
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.ones_like(gate)
    out = silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
    expected = F.silu(gate) * up
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert_bf16_equal_but_for_ties(out[~nan], expected[~nan])


def test_kernels_reject_a_wrong_dtype_or_shape_with_a_clear_error():
    if not kernels_here():
        return
    x, residual, weight = bf16_inputs(2, 8, seed=3)
    ops = torch.ops.radixserve_cpu
    with pytest.raises(RuntimeError, match="rms_norm_bf16 takes bfloat16 tensors, x is Float"):
        ops.rms_norm_bf16(x.float(), weight, EPS)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\] for x of \[2, 8\], got \[7\]"):
        ops.rms_norm_bf16(x, weight[:7], EPS)
    with pytest.raises(RuntimeError, match=r"residual is \[1, 8\], x is \[2, 8\]"):
        ops.fused_add_rms_norm_bf16(x, residual[:1], weight, EPS)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.fused_add_rms_norm_bf16(x.T, residual.T, weight[:2], EPS)
    with pytest.raises(RuntimeError, match="silu_and_mul_bf16 takes bfloat16 tensors, x is Half"):
        ops.silu_and_mul_bf16(x.half())
    with pytest.raises(RuntimeError, match=r"x must be \[\.\.\., 2d\] \(gate then up\), got"):
        ops.silu_and_mul_bf16(x[:, :7].contiguous())


def decode_attention_reference(q, k_buffer, v_buffer, slots, scale):
    """Plain float64 attention of each request's one query over its slots' K/V."""
    heads, kv_heads = q.shape[1], k_buffer.shape[1]
    outs = []
    for i, row in enumerate(slots):
        keys = k_buffer[row].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        values = v_buffer[row].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), keys) * scale
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [
    (64, 14, 2), (128, 4, 4), (64, 8, 2), (16, 4, 2), (80, 8, 1), (256, 16, 2), (32, 32, 1),
])
def test_decode_attention_kernel_writes_the_new_kv_and_equals_a_float64_reference(
    dtype, head_dim, heads, kv_heads
):
    if not kernels_here():
        return
    assert attention_kernels_support(dtype, head_dim) is None
    gen = torch.Generator().manual_seed(head_dim + heads)
    lens = [1, 15, 17, 200]
    num_slots = 600
    k_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    # scattered slots, no two requests sharing one; the new token's slot is each row's last
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    req_to_token = torch.zeros(6, 256, dtype=torch.int64)
    pool_rows = torch.tensor([4, 0, 5, 2])
    start = 0
    for row, n in zip(pool_rows.tolist(), lens, strict=True):
        req_to_token[row, :n] = perm[start : start + n]
        start += n
    seq_lens = torch.tensor(lens)
    loc = torch.stack([req_to_token[r, n - 1] for r, n in zip(pool_rows, lens, strict=True)])
    # q, k, v as row-strided views of one fused projection, as the model passes them
    qkv = torch.randn(4, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(4, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(4, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(4, kv_heads, head_dim)

    out = decode_attention(q, k, v, loc, k_buffer, v_buffer, req_to_token, pool_rows, seq_lens,
                           head_dim**-0.5)

    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    slots = [req_to_token[r, :n] for r, n in zip(pool_rows, lens, strict=True)]
    reference = decode_attention_reference(q, k_buffer, v_buffer, slots, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    else:
        bf16_close(out, reference)


def test_decode_attention_kernel_rejects_bad_input_with_a_clear_error():
    if not kernels_here():
        return
    op = torch.ops.radixserve_cpu.decode_attention
    buf = torch.zeros(8, 2, 64)
    table = torch.zeros(2, 8, dtype=torch.int64)
    ones = torch.ones(2, dtype=torch.int64)

    def call(q=None, k=None, loc=ones, k_buffer=buf, lens=ones):
        q = torch.zeros(2, 4, 64) if q is None else q
        k = torch.zeros(2, 2, 64) if k is None else k
        op(q, k, k, loc, k_buffer, k_buffer.clone(), table, ones, lens, 0.125, torch.empty_like(q))

    call()  # well-formed
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16"):
        call(torch.zeros(2, 4, 64, dtype=torch.half), torch.zeros(2, 2, 64, dtype=torch.half),
             k_buffer=buf.half())
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(k_buffer=buf.bfloat16())
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16 up to 256"):
        call(torch.zeros(2, 4, 40), torch.zeros(2, 2, 40), k_buffer=torch.zeros(8, 2, 40))
    with pytest.raises(RuntimeError, match="do not match"):
        call(k=torch.zeros(3, 2, 64))
    with pytest.raises(RuntimeError, match="loc must be a contiguous int64"):
        call(loc=ones.int())
    with pytest.raises(RuntimeError, match="seq_lens must be a contiguous int64"):
        call(lens=torch.ones(3, dtype=torch.int64))


@pytest.mark.parametrize("heads, head_dim", [(18, 64), (3, 128), (2, 40)])
def test_rotary_kernel_equals_torchs_four_bf16_ops_bit_for_bit(heads, head_dim):
    if not kernels_here():
        return
    gen = torch.Generator().manual_seed(heads)
    emb = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (7,), generator=gen)
    cos, sin = emb(positions, torch.bfloat16)
    # q and k heads as a row-strided view of a wider qkv row, as the model passes them
    qkv = (4 * torch.randn(7, (heads + 1) * head_dim, generator=gen)).to(torch.bfloat16)
    x = qkv[:, : heads * head_dim].view(7, heads, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    torch_ops = x * cos + torch.cat((x2, x1), dim=-1) * sin
    out = rotary(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out.view(torch.int16), torch_ops.view(torch.int16))
    with pytest.raises(RuntimeError, match="rotary_bf16 takes bfloat16 tensors, cos is Float"):
        rotary(x, cos.float(), sin)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        rotary(x, cos[:3], sin[:3])


