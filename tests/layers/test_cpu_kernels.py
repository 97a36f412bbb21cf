"""radixserve's CPU kernels, built where the CPU has AVX-512, against float64 references.

The linear kernels (bf16 and float32, any shape) equal a float64 reference up to rounding and
give a row the same bits in any batch. The fused RMSNorm, add + RMSNorm and SiluAndMul equal
float64 references that round to bf16 where transformers' bf16 modules do. The decode and
extend attention kernels write the new K/V and equal a float64 attention; extend gives a token
the same bits in any chunk or batch. The grammar-mask kernel leaves exactly what xgrammar's apply
leaves. Bad input gets a clear error, a build killed half-way
does not block later loads, and the code for AVX-512 CPUs without BF16, VNNI or AMX passes these
tests too. (The ops and packed weights that call them are tested against their
native references in ``test_custom_ops.py`` and ``test_packed_weight.py``.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers.cpu_kernels import (
    NEWER_ISA,
    _cpu_flags,
    amx_available,
    apply_token_bitmask,
    attention_kernels_support,
    fused_add_rms_norm,
    gemm_amx,
    grouped_gemm_amx,
    has_ops,
    kernel_set,
    linear,
    linear_int8,
    load_cpu_kernels,
    pack_int8_weight,
    pack_linear_weight,
    paged_attention,
    paged_attention_quant,
    rms_norm,
    rotary,
    silu_and_mul,
    small_gemm_amx,
)
from radixserve.layers.quantization.int8 import quantize_int8
from radixserve.layers.rotary_embedding import RotaryEmbedding
from tests.layers.helpers import (
    AVX2_OPS,
    HAS_AMX,
    HAS_KERNELS,
    HAS_LINEAR_KERNEL,
    assert_bf16_equal_but_for_ties,
    bf16_close,
    bf16_inputs,
    require_kernels,
    require_linear_kernel,
    require_ops,
)


def random_problem(n: int, k: int, m: int, bias: bool, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    reference = x.double() @ w.double().T + (b.double() if bias else 0)
    return w, x, b, reference


def test_kernels_build_exactly_where_the_cpu_supports_them():
    assert load_cpu_kernels() == HAS_LINEAR_KERNEL
    assert has_ops("linear") == HAS_LINEAR_KERNEL  # AVX-512 F/BW, or AVX2 and FMA
    assert has_ops(*AVX2_OPS) == HAS_LINEAR_KERNEL  # ... with the elementwise ops
    assert has_ops("linear", "rms_norm", "decode_attention", "linear_int8") == HAS_KERNELS
    assert kernel_set() is None or kernel_set().name == ("avx512" if HAS_KERNELS else "avx2")
    assert not has_ops("no_such_kernel")
    if HAS_LINEAR_KERNEL:
        assert amx_available() == HAS_AMX


def kernel_linear(x, w, b):
    """What ``CpuPackedWeight`` calls: the blocked copy, x padded to its input size."""
    blocked = pack_linear_weight(w)
    pad = blocked.shape[1] * blocked.shape[3] - x.shape[1]
    return linear(F.pad(x, (0, pad)) if pad else x, blocked, b, w.shape[0])


# rows: one, a part of a tile, whole tiles and a remainder, many; columns: whole panels of four
# blocks, a partial block (a vocabulary off 16), fewer blocks than a panel; odd K (bf16 pads it);
# several row tiles over a long input (the weight panel read from L2 by all but the first)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, m, bias", [
    (48, 70, 1, True), (1152, 896, 1, True), (896, 4864, 2, False), (1001, 64, 13, True),
    (40, 71, 7, False), (17, 32, 6, True), (80, 128, 64, False), (7, 9, 100, True),
    (100, 1300, 20, True), (72, 2210, 9, False), (50, 700, 130, True),
])
def test_linear_kernel_equals_a_float64_reference_up_to_rounding(dtype, n, k, m, bias):
    require_linear_kernel()
    w, x, b, reference = random_problem(n, k, m, bias, dtype)
    out = kernel_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5 * k**0.5)
    else:
        bf16_close(out, reference)


@pytest.fixture(scope="session")
def avx512_base_cache(tmp_path_factory) -> Path:
    """The XDG cache of the AVX-512 base build: the killed-build test builds that variant into
    it (a build it needs anyway), and the base variant's own test then loads it instead of
    compiling the library a third time (minutes of the suite)."""
    return tmp_path_factory.mktemp("avx512-base-cache")


def load_in_a_fresh_process(cache: Path, env: dict[str, str] | None = None) -> None:
    script = "from radixserve.layers.cpu_kernels import load_cpu_kernels as f; print(f())"
    # the timeout only turns a regression (a load waiting forever) into a failure
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache), **(env or {})},
                          timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stderr


@pytest.mark.skipif(not HAS_KERNELS, reason="the kernels are not built on this CPU")
def test_what_a_killed_build_leaves_blocks_no_later_load_or_build(tmp_path, avx512_base_cache):
    """A build killed mid-compile leaves cpp_extension's baton file and a scratch directory;
    neither may make a later start wait, with the library cached or still to build. (The
    build from scratch is of the AVX-512 base variant where this CPU has newer instruction
    sets, into the cache that variant's test loads from.)"""
    from radixserve.layers import cpu_kernels

    assert load_cpu_kernels()
    built = cpu_kernels._build_dir(cpu_kernels._cpu_flags(), cpu_kernels.kernel_set())
    base_flags = cpu_kernels._cpu_flags() - NEWER_ISA.keys()
    fresh = avx512_base_cache if not any(avx512_base_cache.iterdir()) else tmp_path / "fresh"
    cases = [(tmp_path / "cached", built, {}),
             (fresh, cpu_kernels._build_dir(base_flags, cpu_kernels.KERNEL_SETS[0]),
              {"RADIXSERVE_CPU_KERNELS_AVX512_BASE": "1"})]
    for cache, build, env in cases:
        kernels = cache / build.parent.relative_to(build.parents[2])
        kernels.mkdir(parents=True, exist_ok=True)
        if cache is cases[0][0]:
            shutil.copytree(built, kernels / built.name)
            (kernels / built.name / "lock").touch()
        (kernels / f"{build.name}.build-killed").mkdir()
        (kernels / f"{build.name}.build-killed" / "lock").touch()
        load_in_a_fresh_process(cache, env)
        assert sorted(p.name for p in kernels.iterdir()) == [build.name, f"{build.name}.lock"]
        assert (kernels / build.name / f"{cpu_kernels.LIBRARY_NAME}.so").exists()


@pytest.mark.skipif(
    not HAS_KERNELS or not NEWER_ISA.keys() & _cpu_flags(),
    reason="this CPU runs the AVX-512 F/BW code itself",
)
@pytest.mark.timeout(1500)  # a build of its own (minutes on a loaded machine), then the tests
def test_kernels_for_avx512_cpus_without_bf16_vnni_or_amx_pass_the_kernel_tests(
        avx512_base_cache):
    """Older AVX-512 CPUs run other code for the bf16 and int8 products, sum fp8 values in
    float32 (no FP16) and have no AMX: built here without those instruction sets (the compiler
    refuses them), it must pass the kernel, packed-weight, op, int8 and KV-cache quantization
    tests as they stand (the AMX kernel's own tests left out: that build has no AMX, and every
    test that runs must run, not skip; the killed-build test too, which has nothing of the
    instruction sets in it and would build the variant again, and the AVX2 build's, a build of
    its own)."""
    repo = Path(__file__).resolve().parents[2]
    tests = ["test_cpu_kernels.py", "test_packed_weight.py", "test_custom_ops.py",
             "test_quantization.py", "test_quantization_int4.py", "test_kv_cache_quant.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "not avx512_cpus_without and not test_amx_ and not killed_build and not avx2_build",
         *[f"tests/layers/{name}" for name in tests]],
        cwd=repo,
        env={**os.environ, "RADIXSERVE_CPU_KERNELS_AVX512_BASE": "1",
             "XDG_CACHE_HOME": str(avx512_base_cache)},
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


# problems whose outputs an AVX2 build must give bit for bit (below): every row-tile height,
# a partial block, odd K, a bias or none
BIT_PROBLEMS = [(1001, 257, 13, True), (40, 71, 7, False), (17, 2048, 32, True)]


def outputs_in_a_fresh_process(path: Path, env: dict[str, str]) -> dict[str, torch.Tensor]:
    """The linear kernel's outputs on ``BIT_PROBLEMS`` in both dtypes, computed by a process
    with ``env`` (which kernel build it loads)."""
    script = (
        "import sys, torch; from tests.layers.test_cpu_kernels import bit_outputs; "
        "torch.save(bit_outputs(), sys.argv[1])"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, **env}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(path)


def bit_outputs() -> dict[str, torch.Tensor]:
    """The float linear kernel's outputs, and the int8 kernel's on the same problems (int8
    weights, per channel and in groups of 64 inputs where K allows)."""
    assert load_cpu_kernels()
    outputs = {f"{dtype}-{n}-{k}-{m}": kernel_linear(x, w, b)
               for dtype in (torch.float32, torch.bfloat16)
               for n, k, m, bias in BIT_PROBLEMS
               for w, x, b, _ in [random_problem(n, k, m, bias, dtype)]}
    for dtype in (torch.float32, torch.bfloat16):
        for n, k, m, bias in BIT_PROBLEMS:
            w, x, b, _ = random_problem(n, k, m, bias, dtype)
            for group in (None, 64) if k % 64 == 0 else (None,):
                q, scales = quantize_int8(w.float(), group)
                weight, blocked_scales = pack_int8_weight(q, scales)
                outputs[f"int8-{group}-{dtype}-{n}-{k}-{m}"] = linear_int8(
                    x, weight, blocked_scales, b, n)
    return outputs


@pytest.mark.skipif(not HAS_KERNELS, reason="this CPU runs the AVX2 build itself, or none")
@pytest.mark.timeout(1500)  # two builds of their own on a loaded machine, then the tests
def test_the_avx2_build_passes_the_linear_tests_with_the_avx512_kernels_bits(
        tmp_path, avx512_base_cache):
    """CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel before Skylake-SP) build
    ``csrc/avx2/``: the linear (float and int8) and elementwise kernels. Built here with AVX-512
    hidden, it must pass their tests as they stand (none skipped), leave the other ops to torch,
    and give what the AVX-512 linear kernels without AVX512-BF16 and VNNI give, bit for bit: the
    same chains of multiply-adds, the same exact int32 sums (float32 layers: the same bits as
    this CPU's own build)."""
    avx2 = {"RADIXSERVE_CPU_KERNELS_AVX2": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "linear_kernel or build_exactly or test_packed_weight or rms_norm or silu_and_mul or "
         "rotary or argmax or wrong_dtype_or_shape or int8_kernel",
         "tests/layers/test_cpu_kernels.py", "tests/layers/test_packed_weight.py",
         "tests/layers/test_custom_ops.py", "tests/layers/test_quantization.py"],
        cwd=repo, env={**os.environ, **avx2}, capture_output=True, text=True, timeout=1400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
    ours = outputs_in_a_fresh_process(tmp_path / "avx2.pt", avx2)
    if NEWER_ISA.keys() & _cpu_flags():  # this CPU's build uses AVX512-BF16 or newer
        base = outputs_in_a_fresh_process(tmp_path / "base.pt", {
            "RADIXSERVE_CPU_KERNELS_AVX512_BASE": "1", "XDG_CACHE_HOME": str(avx512_base_cache)})
    else:
        base = bit_outputs()
    here = bit_outputs()
    assert ours.keys() == base.keys() == here.keys()
    for key in ours:
        assert torch.equal(ours[key], base[key]), key
        if key.startswith("torch.float32"):
            assert torch.equal(ours[key], here[key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_kernel_gives_a_row_the_same_bits_in_every_batch(dtype):
    require_linear_kernel()
    k = 2210  # a long input: several row tiles read each weight panel from L2
    # 200 rows: a prefill's worth of row tiles per block
    w, x, b, _ = random_problem(1001, k, 200, True, dtype)
    full = kernel_linear(x, w, b)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 16), slice(31, 70), slice(90, 200)):
        assert torch.equal(kernel_linear(x[rows].contiguous(), w, b), full[rows])
    # a row-strided view of a wider activation, as the model passes slices
    wide = torch.cat([x, x], dim=1)
    assert torch.equal(kernel_linear(wide[:, :k], w, b), full)


def test_linear_kernel_rejects_bad_input_with_a_clear_error():
    require_linear_kernel()
    blocked = pack_linear_weight(torch.zeros(40, 64, dtype=torch.bfloat16))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear takes bfloat16 or float32 activations, got Ha"):
        linear(x.half(), blocked, None, 40)
    with pytest.raises(RuntimeError, match="linear: x is Float, the weight BFloat16"):
        linear(x.float(), blocked, None, 40)
    with pytest.raises(RuntimeError, match=r"K = 64 \(the weight's padded input size\)"):
        linear(torch.zeros(2, 62, dtype=torch.bfloat16), blocked, None, 40)
    with pytest.raises(RuntimeError, match="n = 30 does not fit the weight's 3 blocks"):
        linear(x, blocked, None, 30)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[40\] tensor"):
        linear(x, blocked, torch.zeros(39, dtype=torch.bfloat16), 40)


# a skip, not a pass, where the CPU has no AMX: bf16 layers run csrc/linear.cpp there (tested
# above), and the count of skips shows what this machine did not run
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX")


# rows: one, a part of a tile, a whole tile, one past it, two tiles; blocks of 16 outputs: whole
# passes of four (or two) and the odd ones after them
@pytest.mark.parametrize("n, k, m, bias", [
    (80, 128, 1, True), (80, 128, 5, False), (48, 64, 16, True), (80, 128, 17, True),
    (112, 96, 31, False), (48, 4864, 32, False), (1152, 896, 24, True),
])
@needs_amx
def test_amx_kernel_equals_a_float64_reference_up_to_bf16_rounding(n, k, m, bias):
    require_kernels()
    w, x, b, reference = random_problem(n, k, m, bias)
    out = small_gemm_amx(x, pack_linear_weight(w), b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    bf16_close(out, reference)


# rows past the small kernel's 32: one 32-row chunk and a tail of 1, whole chunks, a tail in a
# later row block (K = 896 takes 128-row blocks), several row blocks; blocks of 16 outputs: an
# odd count (a last block without its pair), several weight panels (18 blocks each at K = 896,
# 2 at K = 4,864)
@pytest.mark.parametrize("n, k, m, bias", [
    (80, 128, 33, True), (48, 64, 64, False), (1152, 896, 300, True), (896, 4864, 97, False),
    (16, 96, 40, True),
])
@needs_amx
def test_amx_gemm_equals_a_float64_reference_up_to_bf16_rounding(n, k, m, bias):
    require_kernels()
    w, x, b, reference = random_problem(n, k, m, bias)
    packed = pack_linear_weight(w)
    out = gemm_amx(x, packed, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    bf16_close(out, reference)
    # up to 32 rows it is the small-batch kernel
    assert torch.equal(gemm_amx(x[:32], packed, b), small_gemm_amx(x[:32], packed, b))


@needs_amx
def test_amx_kernel_grouped_equals_one_amx_call_per_group():
    """MoE experts in one call: each group's rows times its own weight, the same bits as the
    per-group kernel (1, 16, 17 and 32 rows; 80 outputs: a pass of four blocks and one more)."""
    require_kernels()
    torch.manual_seed(0)
    weights = [torch.randn(80, 128).to(torch.bfloat16) for _ in range(4)]
    packed = [pack_linear_weight(w) for w in weights]
    rows = [1, 16, 17, 32]
    starts = [0, 1, 17, 34, 66]
    x = torch.randn(sum(rows), 128).to(torch.bfloat16)
    out = grouped_gemm_amx(x, packed, starts)
    assert out.shape == (66, 80) and out.dtype == torch.bfloat16
    for g in range(4):
        part = x[starts[g] : starts[g + 1]]
        assert torch.equal(out[starts[g] : starts[g + 1]], small_gemm_amx(part, packed[g], None))
        bf16_close(out[starts[g] : starts[g + 1]], part.double() @ weights[g].double().T)
    with pytest.raises(RuntimeError, match="1 to 32"):
        grouped_gemm_amx(torch.zeros(33, 128, dtype=torch.bfloat16), packed[:1], [0, 33])
    with pytest.raises(RuntimeError, match="one shape"):
        other = pack_linear_weight(torch.randn(32, 128).to(torch.bfloat16))
        grouped_gemm_amx(x[:2], [packed[0], other], [0, 1, 2])
    with pytest.raises(RuntimeError, match="groups \\+ 1 starts"):
        grouped_gemm_amx(x[:2], packed[:2], [0, 2])


@needs_amx
def test_amx_kernel_rejects_what_it_cannot_compute_with_a_clear_error():
    require_kernels()  # loads them when this test runs alone
    packed = pack_linear_weight(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="1 <= M <= 32"):
        small_gemm_amx(torch.zeros(33, 64, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        small_gemm_amx(torch.zeros(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="features"):
        small_gemm_amx(torch.zeros(2, 96, dtype=torch.bfloat16), packed, None)
    odd_k = pack_linear_weight(torch.zeros(32, 70, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        small_gemm_amx(torch.zeros(2, 70, dtype=torch.bfloat16), odd_k, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        small_gemm_amx(torch.zeros(2, 64, dtype=torch.bfloat16), packed,
                       torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemm_amx(torch.zeros(40, 64), packed, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gemm_amx(torch.zeros(40, 70, dtype=torch.bfloat16), odd_k, None)
    with pytest.raises(RuntimeError, match="features"):
        gemm_amx(torch.zeros(40, 96, dtype=torch.bfloat16), packed, None)


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
    require_ops("rms_norm")
    x, _, weight = bf16_inputs(rows, hidden, seed=rows * hidden)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_bf16_equal_but_for_ties(out, rms_norm_reference(x, weight), steps=2)


@pytest.mark.parametrize("rows, hidden", SHAPES)
def test_fused_add_rms_norm_stores_torchs_bf16_sum_and_its_norm_in_place(rows, hidden):
    require_ops("fused_add_rms_norm")
    x, residual, weight = bf16_inputs(rows, hidden, seed=rows + hidden)
    total = x + residual  # torch's bf16 add: the unfused decoder's residual stream
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    fused_add_rms_norm(x, residual, weight, EPS)
    assert x.data_ptr() == x_ptr and residual.data_ptr() == residual_ptr
    assert torch.equal(residual, total)
    assert_bf16_equal_but_for_ties(x, rms_norm_reference(total, weight), steps=2)


@pytest.mark.parametrize("rows, d", SHAPES)
def test_silu_and_mul_kernel_equals_a_float64_reference_with_torchs_roundings(rows, d):
    require_ops("silu_and_mul")
    x, _, _ = bf16_inputs(rows, 2 * d, seed=rows * d + 1)
    out = silu_and_mul(x)
    assert out.shape == (rows, d) and out.dtype == torch.bfloat16
    assert_bf16_equal_but_for_ties(out, silu_and_mul_reference(x))


def test_silu_and_mul_kernel_agrees_with_torch_on_every_bf16_gate():
    require_ops("silu_and_mul")
    # all 65536 bit patterns: the kernel's exp over the whole range, overflow, inf and NaN
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.ones_like(gate)
    out = silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
    expected = F.silu(gate) * up
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert_bf16_equal_but_for_ties(out[~nan], expected[~nan])


def test_kernels_reject_a_wrong_dtype_or_shape_with_a_clear_error():
    require_ops("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary")
    x, residual, weight = bf16_inputs(2, 8, seed=3)
    ops = torch.ops.radixserve_cpu
    with pytest.raises(RuntimeError, match="rms_norm: weight is BFloat16, x is Float"):
        ops.rms_norm(x.float(), weight, EPS)
    with pytest.raises(RuntimeError, match="rms_norm takes bfloat16 or float32 tensors, got Half"):
        ops.rms_norm(x.half(), weight.half(), EPS)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\] for x of \[2, 8\], got \[7\]"):
        ops.rms_norm(x, weight[:7], EPS)
    with pytest.raises(RuntimeError, match=r"residual is \[1, 8\], x is \[2, 8\]"):
        ops.fused_add_rms_norm(x, residual[:1], weight, EPS)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.fused_add_rms_norm(x.T, residual.T, weight[:2], EPS)
    with pytest.raises(RuntimeError, match="silu_and_mul takes bfloat16 or float32 tensors, got"):
        ops.silu_and_mul(x.half())
    with pytest.raises(RuntimeError, match=r"x must be \[\.\.\., 2d\] \(gate then up\), got"):
        ops.silu_and_mul(x[:, :7].contiguous())
    with pytest.raises(RuntimeError, match="rotary: cos is Float, x is BFloat16"):
        ops.rotary(x.view(2, 1, 8), x.view(2, 1, 8).float(), x.view(2, 1, 8))


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
    require_kernels()
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

    out = paged_attention(q, k, v, loc, k_buffer, v_buffer, req_to_token, pool_rows, seq_lens,
                          head_dim**-0.5)

    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    slots = [req_to_token[r, :n] for r, n in zip(pool_rows, lens, strict=True)]
    reference = decode_attention_reference(q, k_buffer, v_buffer, slots, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    else:
        bf16_close(out, reference)


def test_decode_attention_gives_a_request_the_same_bits_alone_or_in_a_batch():
    """At head_dim 128 and 8 query heads per KV head the kernel splits each group into passes
    and the keys into blocks; a request's sums still run in one order whatever surrounds it. A
    batch of at least two requests per thread takes each request's KV heads in one task, a
    request alone one task per KV head: the same bits."""
    require_kernels()
    gen = torch.Generator().manual_seed(7)
    n = max(3, 2 * torch.get_num_threads() + 1)
    heads, kv_heads, head_dim, num_slots = 16, 2, 128, 200 * n + 100
    k_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16()
    v_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16()
    req_to_token = (torch.randperm(num_slots - 1, generator=gen)[:200 * n] + 1).view(n, 200)
    lens = torch.randint(1, 201, (n,), generator=gen)
    lens[:3] = torch.tensor([150, 3, 200])
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    k, v = torch.randn(2, n, kv_heads, head_dim, generator=gen).bfloat16()
    loc = req_to_token[torch.arange(n), lens - 1]

    def run(rows):  # each call writes the new K/V into copies of the pool
        return paged_attention(q[rows], k[rows], v[rows], loc[rows], k_buffer.clone(),
                               v_buffer.clone(), req_to_token, torch.tensor(rows), lens[rows],
                               head_dim**-0.5)

    batch = run(list(range(n)))
    for i in (0, 1, 2, n - 1):
        assert torch.equal(run([i]), batch[i : i + 1])
    assert torch.equal(run([2, 0]), batch[[2, 0]])


def test_decode_attention_over_no_requests_returns_an_empty_output():
    """An empty batch (no request decoding in this step) does nothing, in either kernel."""
    require_kernels()
    k_buffer = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    empty = torch.zeros(0, dtype=torch.int64)
    table = torch.zeros(1, 8, dtype=torch.int64)
    q = torch.zeros(0, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    out = paged_attention(q, kv, kv, empty, k_buffer, k_buffer.clone(), table, empty, empty, 0.125)
    assert out.shape == (0, 4, 64)
    codes = torch.zeros(8, 2, 64, dtype=torch.int8)
    scales = torch.ones(8, 2)
    out = paged_attention_quant(q.float(), codes, codes, scales, scales, table, empty, empty,
                                0.125)
    assert out.shape == (0, 4, 64)


def test_decode_attention_kernel_rejects_bad_input_with_a_clear_error():
    require_kernels()
    op = torch.ops.radixserve_cpu.decode_attention
    buf = torch.zeros(8, 2, 64)
    table = torch.zeros(2, 8, dtype=torch.int64)
    ones = torch.ones(2, dtype=torch.int64)

    def call(q=None, k=None, loc=ones, k_buffer=buf, lens=ones):
        q = torch.zeros(2, 4, 64) if q is None else q
        k = torch.zeros(2, 2, 64) if k is None else k
        op(q, k, k, loc, k_buffer, k_buffer.clone(), table, ones, lens, 0.125, 0, 0.0,
           torch.empty_like(q))

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
    require_ops("rotary")
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
    with pytest.raises(RuntimeError, match="rotary: cos is Float, x is BFloat16"):
        rotary(x, cos.float(), sin)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        rotary(x, cos[:3], sin[:3])




def extend_problem(dtype, head_dim, heads, kv_heads, prefix_lens, extend_lens, seed=0):
    """Requests with cached prefixes (their K/V already in the pool) and new tokens, at
    scattered slots: (kernel arguments, per-request full K/V, queries)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)) + 8
    k_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    req_to_token = torch.zeros(len(prefix_lens) + 2, 512, dtype=torch.int64)
    rows = torch.arange(len(prefix_lens)) + 1
    locs, seq_lens = [], []
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens, strict=True):
        slots = [perm.pop() for _ in range(p + e)]
        req_to_token[row, : p + e] = torch.tensor(slots)
        locs.append(torch.tensor(slots[p:], dtype=torch.int64))
        seq_lens.append(p + e)
    tokens = sum(extend_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return dict(q=q, k=k, v=v, loc=torch.cat(locs), k_buffer=k_buffer, v_buffer=v_buffer,
                req_to_token=req_to_token, req_pool_indices=rows,
                seq_lens=torch.tensor(seq_lens), extend_lens=torch.tensor(extend_lens),
                scale=head_dim**-0.5)


def extend_reference(args, prefix_lens, extend_lens):
    """Causal float64 attention of each request's new tokens over its slots' K/V."""
    q, kb, vb = args["q"], args["k_buffer"], args["v_buffer"]
    heads, kv_heads = q.shape[1], kb.shape[1]
    outs, t0 = [], 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        slots = args["req_to_token"][args["req_pool_indices"][i], : p + e]
        keys = kb[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = vb[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[t0 : t0 + e].double(), keys) * args["scale"]
        future = torch.arange(p + e)[None, :] > (torch.arange(e)[:, None] + p)
        scores = scores.masked_fill(future, float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", scores.softmax(-1), values))
        t0 += e
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [
    (64, 14, 2), (128, 4, 4), (16, 8, 1), (256, 4, 1), (80, 6, 3),
])
def test_extend_attention_kernel_writes_the_new_kv_and_equals_a_float64_reference(
    dtype, head_dim, heads, kv_heads
):
    require_kernels()
    prefix_lens, extend_lens = [0, 37, 5, 100], [70, 1, 16, 33]
    args = extend_problem(dtype, head_dim, heads, kv_heads, prefix_lens, extend_lens)
    out = paged_attention(**args)
    loc = args["loc"]
    assert torch.equal(args["k_buffer"][loc], args["k"]) and torch.equal(
        args["v_buffer"][loc], args["v"])
    reference = extend_reference(args, prefix_lens, extend_lens)
    assert out.shape == args["q"].shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    else:
        bf16_close(out, reference)


def test_extend_attention_gives_a_token_the_same_bits_in_any_chunk_or_batch():
    require_kernels()
    whole = extend_problem(torch.bfloat16, 64, 8, 2, [0], [90], seed=3)
    expected = paged_attention(**whole)
    # the same request prefilled in chunks of 37: each chunk attends over the cached ones
    for start in range(0, 90, 37):
        end = min(start + 37, 90)
        chunk = dict(whole, q=whole["q"][start:end], k=whole["k"][start:end],
                     v=whole["v"][start:end], loc=whole["loc"][start:end],
                     seq_lens=torch.tensor([end]), extend_lens=torch.tensor([end - start]))
        assert torch.equal(paged_attention(**chunk), expected[start:end])
    # and next to other requests in one batch
    mixed = extend_problem(torch.bfloat16, 64, 8, 2, [12, 0], [5, 90], seed=4)
    mixed_out = paged_attention(**dict(mixed, q=torch.cat([mixed["q"][:5], whole["q"]]),
                                       k=torch.cat([mixed["k"][:5], whole["k"]]),
                                       v=torch.cat([mixed["v"][:5], whole["v"]])))
    # (the second request's K/V are the whole one's, at other slots)
    assert torch.equal(mixed_out[5:], expected)


def test_extend_attention_kernel_rejects_bad_input_with_a_clear_error():
    require_kernels()
    args = extend_problem(torch.float32, 64, 4, 2, [0, 3], [4, 2])
    with pytest.raises(RuntimeError, match="extend lengths sum to 5, q has 6 tokens"):
        paged_attention(**dict(args, extend_lens=torch.tensor([3, 2])))
    with pytest.raises(RuntimeError, match=r"extend_lens must be a contiguous int64 \[2\]"):
        paged_attention(**dict(args, extend_lens=torch.tensor([4, 2], dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16 up to 256"):
        bad = extend_problem(torch.float32, 40, 4, 2, [0], [3])
        paged_attention(**bad)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        paged_attention(**dict(args, k_buffer=args["k_buffer"].bfloat16()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, words", [
    (151936, 4748),  # Qwen2's padded vocabulary: whole words
    (1003, 32),  # a last word that is partly outside the vocabulary
    (1003, 30),  # a bitmask narrower than the logits (a vocabulary padded past the tokenizer's)
    (96, 3), (17, 1), (5, 0),
])
def test_token_bitmask_kernel_leaves_what_xgrammars_apply_leaves(dtype, vocab, words):
    import xgrammar as xgr

    require_kernels()
    gen = torch.Generator().manual_seed(vocab + words)
    batch = 5
    # rows with a stride past the vocabulary, as a slice of padded logits
    logits = torch.randn(batch, vocab + 9, generator=gen).to(dtype)[:, :vocab]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # allows everything
    bitmask[3] = 0  # forbids everything it covers
    rows = [0, 1, 3]  # row 2 and 4 are not constrained
    expected, actual = logits.clone(), logits.clone()
    with warnings.catch_warnings():  # xgrammar warns of bitmasks narrower than the logits
        warnings.simplefilter("ignore")
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    apply_token_bitmask(actual, bitmask, rows)
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    assert torch.equal(actual, expected)


def test_token_bitmask_kernel_rejects_bad_input_with_a_clear_error():
    require_kernels()
    logits = torch.zeros(2, 64)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        apply_token_bitmask(logits.half(), bitmask, [0])
    with pytest.raises(RuntimeError, match="int32"):
        apply_token_bitmask(logits, bitmask.long(), [0])
    with pytest.raises(RuntimeError, match="outside the batch"):
        apply_token_bitmask(logits, bitmask, [2])
    with pytest.raises(RuntimeError, match="contiguous rows"):
        apply_token_bitmask(logits.t(), bitmask, [0])


def windowed_reference(args, prefix_lens, extend_lens, window, cap):
    """Float64 attention of each request's new tokens over the keys (p - window, p] of each
    query position p, scores soft-capped to ``cap * tanh(s / cap)`` (cap 0: none)."""
    q, kb, vb = args["q"], args["k_buffer"], args["v_buffer"]
    heads, kv_heads = q.shape[1], kb.shape[1]
    outs, t0 = [], 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        slots = args["req_to_token"][args["req_pool_indices"][i], : p + e]
        keys = kb[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = vb[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[t0 : t0 + e].double(), keys) * args["scale"]
        if cap:
            scores = torch.tanh(scores / cap) * cap
        kv_pos, q_pos = torch.arange(p + e)[None, :], torch.arange(e)[:, None] + p
        hidden = (kv_pos > q_pos) | (kv_pos <= q_pos - window)
        outs.append(torch.einsum("htl,lhd->thd", scores.masked_fill(hidden, float("-inf"))
                                 .softmax(-1), values))
        t0 += e
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, cap", [(17, 0.0), (70, 0.0), (64, 2.5), (1, 0.0), (500, 1.0)])
def test_attention_kernels_with_a_sliding_window_and_soft_cap_equal_a_float64_reference(
    dtype, window, cap
):
    """Prefixes and extends across several 64-key blocks, so the extend kernel starts past the
    first block and rows skip blocks before their window; decode (one new token per request)
    reads only the last ``window`` slots."""
    require_kernels()
    for prefix_lens, extend_lens in (([150, 0, 9, 70], [70, 130, 16, 1]), ([30, 140, 0],
                                                                            [1, 1, 1])):
        args = extend_problem(dtype, 64, 8, 2, prefix_lens, extend_lens, seed=window)
        decode = max(extend_lens) == 1
        call = dict(args, window=window, softcap=cap)
        if decode:
            call.pop("extend_lens")
        out = paged_attention(**call)
        reference = windowed_reference(args, prefix_lens, extend_lens, window, cap)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
        else:
            bf16_close(out, reference)
