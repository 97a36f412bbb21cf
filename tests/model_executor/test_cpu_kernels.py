"""radixserve's CPU kernels, built where the CPU has AVX512-BF16.

The small-batch bf16 linear kernels equal a float64 reference up to bf16 rounding and are taken by
linear layers and the LM head for the batches they cover (one row for the GEMV, up to 32 on AMX)
and by nothing larger. The fused RMSNorm, add + RMSNorm and SiluAndMul equal float64 references
that round to bf16 where transformers' bf16 modules do, and RMSNorm and SiluAndMul take them for
bf16 only. On a CPU without the instruction sets every layer keeps to oneDNN and torch, which
these tests check too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve import envs
from radixserve.layers import activation, layernorm
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.attention import torch_native_backend
from radixserve.layers.cpu_kernels import (
    AMX_MAX_ROWS,
    BlockedWeight,
    _cpu_flags,
    decode_attention,
    decode_attention_supported,
    fused_add_rms_norm,
    gemv,
    load_cpu_kernels,
    rms_norm,
    rotary,
    silu_and_mul,
    small_gemm_amx,
)
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear, mkldnn_linear
from radixserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from radixserve.model_executor import model_runner
from tests.checkpoints import build_checkpoint
from tests.model_executor.harness import ManualSlots, make_runner

# the kernels run here: the CPU has the instructions and RADIXSERVE_DISABLE_CPU_KERNELS is unset
HAS_BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags() and (
    not envs.RADIXSERVE_DISABLE_CPU_KERNELS.get()
)
HAS_AMX = HAS_BF16 and {"amx_tile", "amx_bf16"} <= _cpu_flags()


def bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the output (and of float32 sums in another order)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2**-7, atol=1e-3 * scale)


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


@pytest.mark.parametrize("layer", [
    RowParallelLinear(96, 48, bias=True),
    QKVParallelLinear(64, 16, 4, 2, bias=True),
])
def test_linear_layer_takes_the_kernels_for_small_batches_and_onednn_beyond(layer):
    gen = torch.Generator().manual_seed(0)
    layer.weight.data = torch.randn(layer.weight.shape, generator=gen).to(torch.bfloat16)
    layer.bias.data = torch.randn(layer.bias.shape, generator=gen).to(torch.bfloat16)
    x = torch.randn(AMX_MAX_ROWS + 1, layer.weight.shape[1], generator=gen).to(torch.bfloat16)
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    layer.prepack(blocked=True)
    assert (layer.blocked is not None) == HAS_BF16 and layer.prepacked
    max_rows = layer.blocked.max_rows if layer.blocked is not None else 0
    for rows in (1, 2, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
        out = layer(x[:rows])
        bf16_close(out, reference[:rows])
        if rows <= max_rows:  # exactly the kernel's result
            assert torch.equal(out, layer.blocked.linear(x[:rows], layer.bias))
        else:  # exactly oneDNN's
            assert torch.equal(out, mkldnn_linear(x[:rows], layer.weight, layer.bias))


def test_bf16_runner_decodes_a_batch_alike_with_and_without_the_kernels(llama_path, monkeypatch):
    def decode_logits() -> tuple[torch.Tensor, bool]:
        runner = make_runner(llama_path, dtype="bfloat16")
        slots = ManualSlots(runner)
        seqs = [slots.new_seq() for _ in range(3)]
        runner.forward(slots.extend(seqs, [[5, 9, 30, 41, 7, 100], [8, 2], [77, 3, 12, 50]]))
        used = runner.model.lm_head.blocked is not None
        one = runner.forward(slots.decode(seqs[:1], [3])).float()
        three = runner.forward(slots.decode(seqs, [4, 11, 6])).float()
        return torch.cat([one, three]), used

    with_kernel, used = decode_logits()
    assert used == HAS_BF16
    monkeypatch.setattr(model_runner, "BLOCKED_COPY_MAX_RAM_FRACTION", 0.0)  # no room for copies
    without, used = decode_logits()
    assert not used
    torch.testing.assert_close(with_kernel, without, atol=0.05, rtol=0.05)


EPS = 1e-6
SHAPES = [(rows, hidden) for rows in (1, 3, 64) for hidden in (70, 896, 4864)]


def bf16_inputs(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two bf16 activations of ``shape`` and a weight for its last dimension (around 1)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = (3 * torch.randn(2, *shape, generator=gen)).to(torch.bfloat16)
    weight = (0.5 + torch.rand(shape[-1], generator=gen)).to(torch.bfloat16)
    return x, y, weight


def assert_bf16_equal_but_for_ties(actual: torch.Tensor, expected: torch.Tensor,
                                   steps: int = 1) -> None:
    """Equal but for a rare element ``steps`` bf16 values away: a float32 result an ulp from the
    reference's that rounds to the other side of a bf16 tie (one step before the norm's weight
    is two after it). Same-sign bf16 values are as many steps apart as their bit patterns."""
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    apart = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert apart.max() <= steps and apart.count_nonzero() <= max(1, actual.numel() // 1000)


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


def kernels_here() -> bool:
    """Load the kernels (whichever test runs first); they load exactly where the CPU has
    AVX512-BF16, and elsewhere the layers keep to torch."""
    assert load_cpu_kernels() == HAS_BF16
    return HAS_BF16


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Patch ``module.name`` to count its calls; returns the one-element counter."""
    calls, fn = [0], getattr(module, name)

    def counted(*args: object) -> object:
        calls[0] += 1
        return fn(*args)

    monkeypatch.setattr(module, name, counted)
    return calls


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_takes_the_kernel_for_bf16_and_torch_math_otherwise(dtype, monkeypatch):
    kernel_calls = count_calls(monkeypatch, layernorm, "rms_norm")
    fused_calls = count_calls(monkeypatch, layernorm, "fused_add_rms_norm")
    x, residual, weight = (t.to(dtype) for t in bf16_inputs(5, 96, seed=0))
    norm = RMSNorm(96, EPS)
    norm.weight.data = weight

    def torch_math(h: torch.Tensor) -> torch.Tensor:  # RMSNorm.forward before the kernels
        f = h.float()
        return norm.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)

    total = x + residual
    expected = torch_math(x), torch_math(total)
    out = norm(x)
    normed, new_residual = norm(x, residual)
    kernel = dtype == torch.bfloat16 and HAS_BF16
    assert kernel_calls == fused_calls == [int(kernel)]
    assert torch.equal(new_residual, total)
    if dtype == torch.float32:  # bit for bit: the parity tests compare float32 to transformers
        assert torch.equal(out, expected[0]) and torch.equal(normed, expected[1])
    else:
        assert_bf16_equal_but_for_ties(out, expected[0], steps=2)
        assert_bf16_equal_but_for_ties(normed, expected[1], steps=2)


def test_rms_norm_kernel_takes_qwen3s_per_head_views():
    # q of a fused qkv row, viewed as [tokens, heads, head_dim]: not contiguous
    qkv, _, weight = bf16_inputs(3, 4 * 64 + 2 * 2 * 64, seed=1)
    q = qkv[:, : 4 * 64].reshape(3, 4, 64)
    norm = RMSNorm(64, EPS)
    norm.weight.data = weight[:64]
    out = norm(q)
    assert out.shape == (3, 4, 64)
    assert_bf16_equal_but_for_ties(out, rms_norm_reference(q, norm.weight), steps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_takes_the_kernel_for_bf16_and_torch_otherwise(dtype, monkeypatch):
    kernel_calls = count_calls(monkeypatch, activation, "silu_and_mul")
    x = bf16_inputs(2, 3, 2 * 70, seed=2)[0].to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = SiluAndMul()(x)
    assert kernel_calls == [int(dtype == torch.bfloat16 and HAS_BF16)]
    assert out.shape == (2, 3, 70)
    if dtype == torch.float32:
        assert torch.equal(out, expected)
    else:
        assert_bf16_equal_but_for_ties(out, expected)


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


def test_bf16_decoder_with_the_fused_kernels_matches_the_torch_math(arch_path, monkeypatch):
    def logits() -> torch.Tensor:
        runner = make_runner(arch_path, dtype="bfloat16")
        slots = ManualSlots(runner)
        seqs = [slots.new_seq(), slots.new_seq()]
        runner.forward(slots.extend(seqs, [[5, 9, 30, 41, 7, 100], [8, 2, 77]]))
        return runner.forward(slots.decode(seqs, [3, 11])).float()

    calls = count_calls(monkeypatch, layernorm, "fused_add_rms_norm")
    with_kernels = logits()
    assert (calls[0] > 0) == HAS_BF16
    for module in (layernorm, activation):
        monkeypatch.setattr(module, "bf16_kernels_supported", lambda *tensors: False)
    torch.testing.assert_close(with_kernels, logits(), atol=0.05, rtol=0.05)


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
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 14, 2), (128, 4, 4), (64, 8, 2)])
def test_decode_attention_kernel_writes_the_new_kv_and_equals_a_float64_reference(
    dtype, head_dim, heads, kv_heads
):
    supported = decode_attention_supported(dtype, torch.device("cpu"), head_dim, heads // kv_heads)
    assert supported == kernels_here()
    if not supported:
        return
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
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        call(torch.zeros(2, 4, 32), torch.zeros(2, 2, 32), k_buffer=torch.zeros(8, 2, 32))
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
    assert torch.equal(apply_rotary(x, (cos, sin)), out)  # the layer takes the kernel
    with pytest.raises(RuntimeError, match="rotary_bf16 takes bfloat16 tensors, cos is Float"):
        rotary(x, cos.float(), sin)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        rotary(x, cos[:3], sin[:3])


def test_bf16_decode_through_the_attention_kernel_matches_the_torch_path(tmp_path, monkeypatch):
    # head_dim 64 with 7 query heads per KV head: the shape the kernel takes (the shared test
    # checkpoints have head_dim 16, which keeps to the torch path)
    path = build_checkpoint(tmp_path / "llama", "llama", hidden_size=112, num_attention_heads=14,
                            num_key_value_heads=2, head_dim=64)

    def logits() -> torch.Tensor:
        runner = make_runner(path, dtype="bfloat16")
        slots = ManualSlots(runner)
        seqs = [slots.new_seq() for _ in range(3)]
        runner.forward(slots.extend(seqs, [list(range(5, 45)), [8, 2, 77], [9] * 17]))
        steps = [runner.forward(slots.decode(seqs, [3, 11, 6])).float()]
        steps.append(runner.forward(slots.decode(seqs, [12, 4, 30])).float())
        return torch.stack(steps)

    calls = count_calls(monkeypatch, torch_native_backend, "decode_attention")
    with_kernel = logits()
    assert (calls[0] > 0) == kernels_here()
    monkeypatch.setattr(torch_native_backend, "decode_attention_supported", lambda *a: False)
    torch.testing.assert_close(with_kernel, logits(), atol=0.05, rtol=0.05)
