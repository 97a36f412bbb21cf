"""Attention over a quantized KV pool (``--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2``) in each
backend that reads one (torch_native, the CPU kernels, the Triton kernels in Triton's
interpreter), against plain torch over the pool's dequantized contents, on random paged batches:
the backends must dequantize exactly what the pool holds (int8: codes times their per-(slot,
head) scales; fp8: times the layer's one scale, read through a view with strides 0) and attend
over it, new tokens included. Unowned slots have NaN scales (fp8: NaN codes), so a read of one
shows. Also the pool's quantization itself and its byte accounting.
"""

from __future__ import annotations

import os

import torch

# As in test_triton_attention.py: interpret the Triton kernels where no GPU compiles them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from radixserve.forward_batch import ForwardMode  # noqa: E402
from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.attention import create_attention_backend  # noqa: E402
from radixserve.mem_cache.kv_pool import MHATokenToKVPool  # noqa: E402
from radixserve.mem_cache.kv_quant import (  # noqa: E402
    KV_CACHE_DTYPES,
    dequantize,
    kv_storage_dtype,
    quantize,
)
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool  # noqa: E402
from radixserve.server_args import KV_CACHE_DTYPE_CHOICES  # noqa: E402
from tests.layers.paged_batches import attend, random_batch, reference_attention  # noqa: E402

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
DECODE, EXTEND = ForwardMode.DECODE, ForwardMode.EXTEND


def check(backend: str, seed: int, mode: ForwardMode, dtype: torch.dtype, kv_dtype: torch.dtype,
          heads: int, kv_heads: int, head_dim: int, page_size: int = 4, window: int | None = None,
          cap: float = 0.0, **shape) -> None:
    batch = random_batch(seed, mode, page_size, dtype, heads, kv_heads, head_dim,
                         kv_dtype=kv_dtype, **shape)
    if not batch.pool.row_scaled:
        assert batch.pool.k_scale_buffer[0].stride() == (0, 0)  # the layer's one scale
    out = attend(backend, batch, window=window, cap=cap)
    assert out.dtype == dtype and not out.isnan().any()
    expected = reference_attention(batch, window, cap)
    # the dequantized K/V are the same numbers in every backend; what differs is the order of
    # float32 sums and, for half-precision activations, their rounding
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


CASES = [  # (seed, mode, heads, kv_heads, head_dim)
    (0, DECODE, 4, 2, 64),
    (1, EXTEND, 4, 1, 64),
    (2, DECODE, 6, 3, 128),
    (3, EXTEND, 2, 2, 128),
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(("seed", "mode", "heads", "kv_heads", "head_dim"), CASES)
def test_torch_native_reads_a_quantized_pool(kv_dtype, seed, mode, heads, kv_heads, head_dim):
    check("torch_native", seed, mode, torch.float32, kv_dtype, heads, kv_heads, head_dim)


needs_cpu_kernels = pytest.mark.skipif(
    cpu_kernels.attention_kernels_support(torch.int8, 64) is not None,
    reason="radixserve's CPU kernels do not run here",
)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(("seed", "mode", "heads", "kv_heads", "head_dim"), CASES)
def test_cpu_kernels_read_a_quantized_pool(dtype, kv_dtype, seed, mode, heads, kv_heads,
                                           head_dim):
    check("cpu", seed, mode, dtype, kv_dtype, heads, kv_heads, head_dim)


@needs_cpu_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_cpu_kernels_over_many_key_blocks(kv_dtype):
    """Requests longer than the kernels' key blocks (64), prefills over several query blocks."""
    for seed, mode in ((20, DECODE), (21, EXTEND)):
        check("cpu", seed, mode, torch.float32, kv_dtype, 8, 2, 64, page_size=16,
              max_prefix=200, max_extend=40, max_bs=4)


WINDOW_CASES = [(5, 0.0), (70, 0.0), (None, 1.5), (9, 2.0)]  # (sliding window, soft cap)


@pytest.mark.parametrize("backend", [
    "torch_native", pytest.param("cpu", marks=needs_cpu_kernels),
])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize(("window", "cap"), WINDOW_CASES)
def test_quantized_pool_with_sliding_window_and_soft_cap(backend, kv_dtype, window, cap):
    """Gemma 2 / Mistral layers over a quantized pool: the window and the cap apply to the
    dequantized scores exactly as over a plain pool (prefills longer than the window included)."""
    for seed, mode in ((30, DECODE), (31, EXTEND)):
        check(backend, seed, mode, torch.float32, kv_dtype, 4, 2, 64, page_size=16,
              window=window, cap=cap, max_prefix=150, max_extend=40, max_bs=3)


interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(("seed", "mode"), [(5, DECODE), (6, EXTEND)])
def test_triton_reads_a_quantized_pool(dtype, kv_dtype, seed, mode):
    check("triton", seed, mode, dtype, kv_dtype, 4, 2, 64)


@pytest.mark.parametrize("backend", [
    "torch_native",
    pytest.param("cpu", marks=needs_cpu_kernels),
    pytest.param("triton", marks=interpreted),
])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_pool_under_a_layer_scale_other_than_one(backend, kv_dtype, dtype):
    """fp8 codes under one scale per layer (a calibrated checkpoint's, here 1/16): every backend
    multiplies by it (a kernel that ignored the broadcast scale would be 16x off), in decode
    (the bf16 model's narrower score pass included) and in prefill."""
    if backend == "triton" and dtype == torch.bfloat16:
        dtype = torch.float16  # the interpreter computes bf16 wrongly
    for seed, mode in ((40, DECODE), (41, EXTEND)):
        check(backend, seed, mode, dtype, kv_dtype, 4, 2, 64, kv_tensor_scale=1 / 16)


@interpreted
@pytest.mark.parametrize(("window", "cap"), WINDOW_CASES)
def test_triton_quantized_pool_with_sliding_window_and_soft_cap(window, cap):
    for seed, mode in ((30, DECODE), (31, EXTEND)):
        check("triton", seed, mode, torch.float32, torch.int8, 4, 2, 64, page_size=16,
              window=window, cap=cap, max_prefix=150, max_extend=40, max_bs=3)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_quantize_round_trip(kv_dtype):
    """Per-row scales: each row's largest magnitude is kept (to the format's precision), an
    all-zero row stays zero, and the error is bounded by the format's step."""
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0
    codes, scale = quantize(x, kv_dtype)
    assert codes.dtype == kv_dtype and scale.shape == (50, 3)
    y = dequantize(codes, scale, torch.float32)
    assert torch.equal(y[7, 1], torch.zeros(64))
    rel = {torch.int8: 1 / 254, torch.float8_e4m3fn: 1 / 16, torch.float8_e5m2: 1 / 8}[kv_dtype]
    bound = x.abs().amax(-1, keepdim=True) * rel * 1.01
    assert ((y - x).abs() <= bound).all()


def test_pool_bytes_and_slot_buffers():
    """An int8 pool counts its codes and scales: about half a bf16 pool's bytes per token
    (64-dim heads: 68 bytes against 128), so the same budget holds ~1.9x the tokens. An fp8
    pool stores its codes alone (one scale per layer, not per slot): exactly half."""
    bf16 = MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.bfloat16)
    int8 = MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.int8)
    assert bf16 == 2 * 30 * 3 * 64 * 2 and int8 == 2 * 30 * 3 * (64 + 4)
    assert bf16 / int8 > 1.85
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert MHATokenToKVPool.bytes_per_token(3, 64, 30, fp8) * 2 == bf16
    pool = MHATokenToKVPool(16, 4, torch.int8, 3, 64, 2, "cpu")
    assert pool.size_bytes() == 20 * MHATokenToKVPool.bytes_per_token(3, 64, 2, pool.dtype)
    buffers = pool.slot_buffers(1)
    assert [b.dtype for b in buffers] == [torch.int8] * 2 + [torch.float32] * 2
    assert all(b.shape[0] == 20 for b in buffers)
    fp8 = MHATokenToKVPool(16, 4, torch.float8_e5m2, 3, 64, 2, "cpu",
                           layer_scales=[(0.5, 0.25), (2.0, 4.0)])
    assert fp8.size_bytes() == 20 * 2 * 2 * 3 * 64
    assert [b.dtype for b in fp8.slot_buffers(1)] == [torch.float8_e5m2] * 2
    for layer, pair in enumerate([(0.5, 0.25), (2.0, 4.0)]):  # each layer's own K and V scale
        for scales, value in zip(fp8.get_kv_scale_buffers(layer), pair, strict=True):
            assert scales.shape == (20, 3) and scales.stride() == (0, 0)
            assert torch.equal(scales, torch.full((20, 3), value))
    plain = MHATokenToKVPool(16, 4, torch.bfloat16, 3, 64, 2, "cpu")
    assert len(plain.slot_buffers(0)) == 2 and plain.get_kv_scale_buffers(0) is None


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_pool_saturates_past_its_range(kv_dtype):
    """A value past the format's largest times the layer's scale (K's and V's their own) is
    stored as that largest, with its sign (a plain cast would store NaN or inf); the rest round
    to the format."""
    pool = MHATokenToKVPool(8, 4, kv_dtype, 1, 16, 1, "cpu", layer_scales=[(0.25, 0.5)])
    k = torch.linspace(-3, 3, 16).reshape(1, 1, 16)
    k[0, 0, :2] = torch.tensor([1e6, -1e6])
    pool.set_kv_buffer(0, torch.tensor([5]), k, -k)
    got_k, got_v = pool.get_dequantized(0, torch.tensor([5]), torch.float32)
    top = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[kv_dtype]
    assert got_k[0, 0, :2].tolist() == [0.25 * top, -0.25 * top]
    assert got_v[0, 0, :2].tolist() == [-0.5 * top, 0.5 * top]
    rel = {torch.float8_e4m3fn: 1 / 16, torch.float8_e5m2: 1 / 8}[kv_dtype]
    for got, want in ((got_k, k), (got_v, -k)):
        assert ((got[0, 0, 2:] - want[0, 0, 2:]).abs() <= want[0, 0, 2:].abs() * rel).all()


def test_kv_cache_dtype_names():
    assert set(KV_CACHE_DTYPE_CHOICES) == set(KV_CACHE_DTYPES)
    assert kv_storage_dtype("auto", torch.float32) == torch.float32
    assert kv_storage_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_dtype("q4_0", torch.float32)


def test_a_backend_refuses_a_dtype_it_cannot_read(monkeypatch):
    """The cpu backend on a machine without its kernels names the KV dtype and the reason."""
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: False)
    pool = MHATokenToKVPool(8, 1, torch.int8, 1, 64, 1, "cpu")
    with pytest.raises(ValueError, match=r"cpu attention backend.*torch\.int8"):
        create_attention_backend("cpu", ReqToTokenPool(2, 8, "cpu"), pool)


def _codes(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random KV codes of ``dtype``: every int8 value, or fp8 codes of values about as large as
    int8's (times the same scales: softmax not saturated), with magnitudes spread over 2^10
    (e4m3's subnormals too), both signs."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    spread = torch.exp2(torch.randint(-10, 1, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * spread * 100).to(dtype)


@needs_cpu_kernels
@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (14, 2, 64),
                                                            (8, 8, 128), (4, 1, 256), (4, 2, 80)])
@pytest.mark.parametrize(("window", "cap"), [(None, 0.0), (50, 1.5)])
def test_scores_of_bf16_queries_in_narrower_forms(codes, heads, kv_heads, head_dim, window,
                                                  cap):
    """``bf16_query`` (the backend's choice for bf16 models): int8 keys scored against the
    query quantised to int16 give what float32 scoring gives, to the int16 rounding (a 2^-16
    share of the query's largest value per element, far below bf16's 2^-8); fp8 keys read as
    bf16 by table and scored with bf16 dot products give it to the order of the sums (the
    products are exact); a head_dim that is not a multiple of 32 keeps the float32 pass, bit for
    bit."""
    gen = torch.Generator().manual_seed(head_dim + heads)
    batch, ctx = 3, 150  # several key blocks of 64
    slots = batch * ctx + 1
    k = _codes(codes, (slots, kv_heads, head_dim), gen)
    v = _codes(codes, (slots, kv_heads, head_dim), gen)
    k_scale = torch.rand(slots, kv_heads, generator=gen) * 0.02
    v_scale = torch.rand(slots, kv_heads, generator=gen) * 0.02
    table = (1 + torch.randperm(batch * ctx, generator=gen)).view(batch, ctx)
    q = (torch.randn(batch, heads, head_dim, generator=gen) * 2).bfloat16().float()
    lens = torch.tensor([ctx, ctx - 37, 1])

    def attend_with(bf16_query: bool) -> torch.Tensor:
        return cpu_kernels.paged_attention_quant(
            q, k, v, k_scale, v_scale, table, torch.arange(batch), lens, head_dim ** -0.5,
            window=window, softcap=cap, bf16_query=bf16_query,
        )

    exact, fast = attend_with(False), attend_with(True)
    if head_dim % 32:
        assert torch.equal(fast, exact)
    else:
        assert not torch.equal(fast, exact)  # the narrower pass ran
        torch.testing.assert_close(fast, exact, atol=2e-4 * exact.abs().max().item(), rtol=0)


@needs_cpu_kernels
@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 128), (4, 2, 80)])
def test_values_of_an_fp8_pool_summed_in_fp16(codes, heads, kv_heads, head_dim):
    """An fp8 pool under one scale per layer, read for a bf16 model (``bf16_query``): on a CPU
    with AVX512-FP16 the value pass sums 16 rows' probabilities times codes in fp16 lanes
    before float32 (decode_fp16.h), elsewhere all in float32. Either way the output is the
    float32 pass's to within 2^-11 of the values' largest magnitude (a bf16 output is itself
    rounded to 2^-9 of its own); a head_dim that is not a multiple of 32 keeps the float32
    passes, bit for bit."""
    gen = torch.Generator().manual_seed(head_dim + heads + 1)
    batch, ctx = 3, 300  # several key blocks of 64
    slots = batch * ctx + 1
    k = _codes(codes, (slots, kv_heads, head_dim), gen)
    v = _codes(codes, (slots, kv_heads, head_dim), gen)
    layer_scale = torch.full((1, 1), 0.013).expand(slots, kv_heads)  # strides (0, 0)
    table = (1 + torch.randperm(batch * ctx, generator=gen)).view(batch, ctx)
    q = (torch.randn(batch, heads, head_dim, generator=gen) * 2).bfloat16().float()
    lens = torch.tensor([ctx, ctx - 37, 1])

    def attend_with(bf16_query: bool) -> torch.Tensor:
        return cpu_kernels.paged_attention_quant(
            q, k, v, layer_scale, layer_scale, table, torch.arange(batch), lens,
            head_dim ** -0.5, bf16_query=bf16_query,
        )

    exact, fast = attend_with(False), attend_with(True)
    if head_dim % 32:
        assert torch.equal(fast, exact)
        return
    largest = (v.float().abs().max() * 0.013).item()
    error = (fast - exact).abs().max().item()
    assert 0 < error <= largest * 2 ** -11
