"""radixserve's own CPU kernels (``layers/csrc``), compiled on first use, once per machine.

- linear layers at every batch size, bf16 and float32 (``csrc/linear.cpp``): one blocked copy of
  each weight, ``[N/16][K/2][16][2]`` (bf16) or ``[N/16][K][16]``, multiplied in register tiles
  with FMA (bf16 with AVX512-BF16's ``vdpbf16ps`` where the CPU has it). Decode steps stream the
  weight at memory speed (oneDNN's GEMV reaches about half of it), prefills run near the GEMM
  peak, and a row's output does not depend on the batch it is in. On CPUs with AMX, bf16
  batches of up to 32 rows can take an AMX kernel on the same copy (``csrc/linear_amx.cpp``);
  which kernel (or oneDNN's ``F.linear``) runs each batch size is ``layers/kernel_dispatch.py``'s
  measured choice; int8 weights (``csrc/linear_int8.cpp``) and 4-bit ones with a scale and an
  offset per 32 inputs, GGUF's Q4_1 arithmetic (``csrc/linear_int4.cpp``), multiply int16
  activations with AVX512-VNNI;
- fused RMSNorm, residual add + RMSNorm, SiluAndMul and the rotary embedding in bf16 and
  float32, and the greedy argmax of the logits (``csrc/elementwise.cpp``): one kernel each where
  torch runs up to nine, whose start-up costs dominate a decode step's small tensors. They round
  where transformers' modules do;
- the LoRA deltas of a decode step added to a layer's output in one call (``csrc/lora.cpp``),
  where torch runs six ops per adapted layer;
- a grammar's token bitmask applied to the logits (``csrc/token_bitmask.cpp``): masked stores
  of ``-inf``, a word of the bitmask at a time, where xgrammar's CPU apply tests each token;
- attention straight from the paged KV pool (float32 and bf16, head_dim a multiple of 16 up to
  256, any GQA group): one call per layer writes the new K/V and attends, where the torch path
  runs two index_puts, two gathers, a mask and SDPA. Decode (``csrc/decode_attention.cpp``):
  one query per request; prefill (``csrc/extend_attention.cpp``): flash-style, blocks of keys
  with an online softmax, so a long chunk is not quadratic in memory.

Nothing asks on every call whether they run: each op picks them once, when the model is built
(``layers/custom_op.py``), weights are packed for them once, after loading
(``layers/packed_weight.py``), and the ``cpu`` attention backend calls the attention kernel.

The full set needs AVX-512 F and BW. BF16, FP16 (an fp8 KV cache's values), VNNI (int8 weights)
and AMX instructions are used where the CPU has them and replaced by AVX-512 F/BW sequences where
it does not (the same sums, or float32 ones for FP16's), so older AVX-512 CPUs (Skylake, Cascade
Lake) run every kernel, float32 models included; ``RADIXSERVE_CPU_KERNELS_AVX512_BASE=1``
builds that code on a newer CPU. CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel
before Skylake-SP) build ``csrc/avx2/``: the linear kernel, on the same blocked weight and with
the same sums (the bits of the AVX-512 kernel without AVX512-BF16; torch's own GEMMs are slowest
there, bf16 at 15-19 GFLOP/s on a Zen 3 at every batch size), the int8 kernel (the same int32
sums, without VNNI) and the elementwise ops (norms, SwiGLU, rotary, argmax: the same row
functions with 8-lane registers). The attention, LoRA, int4 and token-bitmask ops keep their
torch implementations there (``has_ops`` says which
kernels a build registers;
``RADIXSERVE_CPU_KERNELS_AVX2=1`` builds the AVX2 set on an AVX-512 CPU). The build goes through
``torch.utils.cpp_extension`` (ninja and g++, about 20 s) into
``~/.cache/radixserve/kernels/<key>``; the key covers the sources, the torch version and this CPU's
flags (the code is built for the CPU it runs on), so later starts load the cached library at once.
Builds are serialised by an ``fcntl`` lock on ``<key>.lock``, which the kernel releases when its
holder dies, and compile in a scratch directory of their own: a build killed half-way leaves
nothing that later starts wait on. Without a compiler or either
instruction set, or with ``RADIXSERVE_DISABLE_CPU_KERNELS=1``, ``load_cpu_kernels`` returns False
and ops are built with their torch implementations.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve import envs
from radixserve.cache_files import exclusive, source_digest

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
HEADERS = tuple(sorted(CSRC.rglob("*.h")))  # csrc/avx2/ has its own


@dataclass(frozen=True)
class KernelSet:
    """One build of the kernels for a class of CPUs: the instructions it needs, its sources and
    the g++ options that keep newer instructions out of its code."""

    name: str
    needs: frozenset[str]
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = ()


# Best first: a CPU builds the first set whose instructions it has. The AVX2 set holds the
# linear, int8 and elementwise kernels (csrc/avx2/): there the other ops keep torch's.
KERNEL_SETS = (
    KernelSet("avx512", frozenset({"avx512f", "avx512bw"}), tuple(sorted(CSRC.glob("*.cpp")))),
    KernelSet(
        "avx2",
        frozenset({"avx2", "fma"}),
        tuple(sorted((CSRC / "avx2").glob("*.cpp"))),
        ("-mno-avx512f",),  # also when RADIXSERVE_CPU_KERNELS_AVX2 builds it on an AVX-512 CPU
    ),
)
SOURCES = tuple(source for kernel_set in KERNEL_SETS for source in kernel_set.sources)
LIBRARY_NAME = "radixserve_cpu_kernels"
BLOCK_ROWS = 16  # output rows per weight block (csrc/linear.cpp)
AMX_MAX_ROWS = 32  # input rows small_gemm_amx and grouped_gemm_amx take (two tiles of 16)
AMX_K_MULTIPLE = 32  # inputs per AMX tile row


# instruction sets past AVX-512 F/BW the kernels use where present: /proc/cpuinfo flag -> the
# g++ option that leaves it out of a RADIXSERVE_CPU_KERNELS_AVX512_BASE build
NEWER_ISA = {
    "avx512_bf16": "-mno-avx512bf16",
    "avx512_fp16": "-mno-avx512fp16",
    "avx512_vnni": "-mno-avx512vnni",
    "avx_vnni": "-mno-avxvnni",
    "amx_tile": "-mno-amx-tile",
    "amx_bf16": "-mno-amx-bf16",
    "amx_int8": "-mno-amx-int8",
}


def _cpu_flags() -> set[str]:
    """This CPU's instruction sets, as the kernels are built for them (without ``NEWER_ISA``
    under ``RADIXSERVE_CPU_KERNELS_AVX512_BASE``, without AVX-512 and AMX under
    ``RADIXSERVE_CPU_KERNELS_AVX2``)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    flags = set(line.partition(":")[2].split())
    if envs.RADIXSERVE_CPU_KERNELS_AVX2.get():
        return {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    return flags - NEWER_ISA.keys() if envs.RADIXSERVE_CPU_KERNELS_AVX512_BASE.get() else flags


def cpu_flags() -> set[str]:
    """This CPU's instruction sets as the kernels are built for them (part of the kernel
    dispatch cache's key, ``layers/kernel_dispatch.py``)."""
    return _cpu_flags()


@functools.cache
def kernel_sources_digest() -> str:
    """A digest of the kernels' sources: part of their build directory's name and of the
    kernel dispatch cache's key (``layers/kernel_dispatch.py``), read once per process."""
    return source_digest(*SOURCES, *HEADERS)


def kernel_set() -> KernelSet | None:
    """The kernels this CPU builds (None: it has neither AVX-512 F/BW nor AVX2 and FMA)."""
    flags = _cpu_flags()
    return next((ks for ks in KERNEL_SETS if ks.needs <= flags), None)


def _build_dir(flags: set[str], kernels: KernelSet) -> Path:
    key = hashlib.sha256(kernel_sources_digest().encode())
    key.update(kernels.name.encode())
    key.update(torch.__version__.encode())
    key.update(" ".join(sorted(flags)).encode())
    return envs.radixserve_cache_dir("kernels", key.hexdigest()[:16])


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs ``ninja`` from PATH; the ``ninja`` package's binary sits in the
    environment's bin directory, which is not on PATH when the venv is not activated."""
    import ninja

    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _build_and_load(
    build_dir: Path, library: Path, kernels: KernelSet, left_out: list[str]
) -> None:
    """Compile into a scratch directory of this process, then move the library into place.

    ``cpp_extension`` guards its build directory with a plain ``lock`` file that only a live
    builder deletes; in a shared directory, one left by a killed build makes every later
    ``load`` wait forever. A private scratch directory has no such file."""
    from torch.utils.cpp_extension import load

    logger.info("building radixserve's CPU kernels into %s (once)", build_dir)
    with tempfile.TemporaryDirectory(
        dir=build_dir.parent, prefix=f"{build_dir.name}.build-"
    ) as scratch, _ninja_on_path():
        load(  # builds the library and loads it into this process
            name=LIBRARY_NAME,
            sources=[str(s) for s in kernels.sources],
            # -fopenmp: at::parallel_for runs on torch's own OpenMP threads (same libgomp);
            # no contraction: a product and a sum round separately, as torch's kernels do
            extra_cflags=[
                "-O3", "-march=native", *left_out, *kernels.cflags, "-fopenmp",
                "-ffp-contract=off",
            ],
            extra_ldflags=["-fopenmp"],
            build_directory=scratch,
            is_python_module=False,
        )
        os.replace(Path(scratch) / f"{LIBRARY_NAME}.so", library)


@functools.cache
def load_cpu_kernels() -> bool:
    """Register ``torch.ops.radixserve_cpu.*``; False when they cannot run here."""
    kernels = kernel_set()
    if envs.RADIXSERVE_DISABLE_CPU_KERNELS.get() or kernels is None:
        return False
    flags = _cpu_flags()
    left_out = [option for flag, option in NEWER_ISA.items() if flag not in flags]
    try:
        build_dir = _build_dir(flags, kernels)
        build_dir.mkdir(parents=True, exist_ok=True)
        library = build_dir / f"{LIBRARY_NAME}.so"
        with exclusive(build_dir.with_suffix(".lock")):
            # no other builder is alive: scratch directories are what killed builds left
            for leftover in build_dir.parent.glob(f"{build_dir.name}.build-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            if library.exists():
                torch.ops.load_library(str(library))
            else:
                _build_and_load(build_dir, library, kernels, left_out)
    except Exception as e:  # no compiler, no ninja, a failed build: torch still works
        logger.warning("radixserve's CPU kernels are unavailable, using torch's: %s", e)
        return False
    return True


def has_ops(*names: str) -> bool:
    """Whether the kernels load here and register every op in ``names``
    (``torch.ops.radixserve_cpu.<name>``): an AVX-512 build has them all, an AVX2 build the
    linear and elementwise ones."""
    return load_cpu_kernels() and all(_registered(name) for name in names)


@functools.cache
def _registered(name: str) -> bool:
    return hasattr(torch.ops.radixserve_cpu, name)  # asked once the library is loaded


@functools.cache
def amx_available() -> bool:
    """Whether this CPU has AMX for bf16, the kernels load, and Linux grants this process the
    tile state (it must be asked for; kernels before 5.16 cannot)."""
    return (
        {"amx_tile", "amx_bf16"} <= _cpu_flags()
        and load_cpu_kernels()
        and torch.ops.radixserve_cpu.amx_permitted()
    )


# the activation dtypes every kernel takes
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The blocked copy of an ``[N, K]`` bf16 or float32 weight that ``linear`` multiplies
    with: ``[ceil(N/16), K/2, 16, 2]`` (bf16, K padded to even) or ``[ceil(N/16), K, 16, 1]``,
    the padding zero."""
    return pack_linear_weight_as(weight, step=2 if weight.dtype == torch.bfloat16 else 1)


def pack_linear_weight_as(weight: torch.Tensor, step: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` blocked as ``[ceil(N/16), K/step, 16, step]``, zero-padded."""
    n, k = weight.shape
    blocks, padded_k = -(-n // BLOCK_ROWS), -(-k // step) * step
    padded = torch.zeros(blocks * BLOCK_ROWS, padded_k, dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight.detach()
    blocked = padded.view(blocks, BLOCK_ROWS, padded_k // step, step).permute(0, 2, 1, 3)
    return blocked.contiguous()


def linear(
    x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: ``x`` ``[M, K]`` with K the weight's padded input size and
    rows contiguous, ``blocked`` from ``pack_linear_weight``, ``n`` the weight's rows."""
    return torch.ops.radixserve_cpu.linear(x, blocked, bias, n)


def pack_int8_weight(
    weight: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked copies of an int8 ``[N, K]`` weight and its float32 ``[N, groups]`` scales
    that ``linear_int8`` reads: ``[ceil(N/16), K/2, 16, 2]`` (K padded to even) and
    ``[ceil(N/16), groups, 16]``, the padding zero."""
    n, groups = scales.shape
    blocks = -(-n // BLOCK_ROWS)
    padded = torch.zeros(blocks * BLOCK_ROWS, groups, dtype=torch.float32)
    padded[:n] = scales
    blocked_scales = padded.view(blocks, BLOCK_ROWS, groups).permute(0, 2, 1).contiguous()
    return pack_linear_weight_as(weight, step=2), blocked_scales


def linear_int8(
    x: torch.Tensor,
    blocked: torch.Tensor,
    blocked_scales: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """``x @ (q * scale).T (+ bias)`` for bf16 or float32 ``x`` ``[M, K]`` (rows contiguous)
    and the copies of ``pack_int8_weight``; ``n`` the weight's rows."""
    return torch.ops.radixserve_cpu.linear_int8(x, blocked, blocked_scales, bias, n)


INT4_GROUP = 32  # inputs per scale and offset of a 4-bit weight (csrc/linear_int4.cpp)


def pack_int4_weight(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The copies of a 4-bit weight (uint8 codes in [0, 15] ``[N, K]``, fp16 scales and offsets
    ``[N, K/32]``) that ``linear_int4`` reads: codes ``[ceil(N/16), K/4, 32]`` two to a byte
    (input ``4c + e`` of column ``j`` in the low nibble of byte ``2j + e`` of chunk ``c``, input
    ``4c + 2 + e`` in its high nibble), scales and offsets ``[ceil(N/16), K/32, 16]``; K is
    padded to a multiple of 32 with zero codes, N to 16 with zero scales."""
    n, k = codes.shape
    groups = scales.shape[1]
    if groups * INT4_GROUP < k:
        raise ValueError(f"{groups} groups of {INT4_GROUP} do not cover {k} inputs")
    blocks, padded_k = -(-n // BLOCK_ROWS), groups * INT4_GROUP
    padded = torch.zeros(blocks * BLOCK_ROWS, padded_k, dtype=torch.uint8)
    padded[:n, :k] = codes
    # [blocks, 16 columns, chunks, 2 halves, 2 parities] -> [blocks, chunks, 16, 2 parities, 2]
    quads = padded.view(blocks, BLOCK_ROWS, padded_k // 4, 2, 2).permute(0, 2, 1, 4, 3)
    packed = quads[..., 0] | (quads[..., 1] << 4)
    blocked = packed.reshape(blocks, padded_k // 4, 2 * BLOCK_ROWS).contiguous()

    def per_block(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(blocks * BLOCK_ROWS, groups, dtype=torch.float16)
        out[:n] = values
        return out.view(blocks, BLOCK_ROWS, groups).permute(0, 2, 1).contiguous()

    return blocked, per_block(scales), per_block(offsets)


def linear_int4(
    x: torch.Tensor,
    blocked: torch.Tensor,
    blocked_scales: torch.Tensor,
    blocked_offsets: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """``x @ (q * scale + offset).T (+ bias)`` for bf16 or float32 ``x`` ``[M, K]`` (rows
    contiguous) and the copies of ``pack_int4_weight``; ``n`` the weight's rows."""
    return torch.ops.radixserve_cpu.linear_int4(
        x, blocked, blocked_scales, blocked_offsets, bias, n
    )


def small_gemm_amx(
    x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for up to 32 bf16 rows on AMX (N a multiple of 16, K of 32)."""
    return torch.ops.radixserve_cpu.small_gemm_amx_bf16(x.contiguous(), blocked, bias)


def gemm_amx(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for any number of bf16 rows on AMX (N a multiple of 16, K of
    32): ``small_gemm_amx``'s kernel up to 32 rows, a cache-blocked tile GEMM above."""
    return torch.ops.radixserve_cpu.gemm_amx_bf16(x.contiguous(), blocked, bias)


def lora_add_(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
    blocks: torch.Tensor,
) -> None:
    """In place: ``out[i] += (x[i] @ a[s].T) @ bt[s]`` for each row ``i`` whose int64 slot
    ``s = slots[i]`` is not negative (``csrc/lora.cpp``): bf16 or float32 ``out`` ``[M, N]`` and
    ``x`` ``[M, K]``, ``a`` ``[S, R, K]`` and ``bt`` ``[S, P]`` (per slot, each block's B
    transposed in chunks of 64 output columns, ``LoRADelta._kernel_weights``), float32 or
    bf16, all contiguous;
    ``blocks`` int64 ``[nb, 4]``: ranks ``[r0, r1)`` feed columns ``[c0, c1)`` only (``bt`` is
    taken as zero elsewhere)."""
    torch.ops.radixserve_cpu.lora_add_(out, x, a, bt, slots, blocks)


def grouped_gemm_amx(
    x: torch.Tensor, blocked: list[torch.Tensor], starts: list[int]
) -> torch.Tensor:
    """``x[starts[g]:starts[g+1]] @ weight_g.T`` for every group ``g`` (1 to 32 bf16 rows each,
    one shape of blocked weight for all) in one call: MoE experts on AMX."""
    return torch.ops.radixserve_cpu.grouped_gemm_amx_bf16(x.contiguous(), blocked, starts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dimension of ``x`` in one pass per row (torch runs
    eight kernels); a non-contiguous ``x`` (Qwen3's per-head q/k views) is copied first."""
    return torch.ops.radixserve_cpu.rms_norm(x.contiguous(), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual)``: one kernel for the
    residual add and the next norm (torch: nine). Both must be contiguous, of one shape."""
    torch.ops.radixserve_cpu.fused_add_rms_norm(x, residual, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in one kernel (torch: four), rounding as torch's ops
    do; ``x`` ``[n, heads, head_dim]`` may be a row-strided view of the qkv output."""
    return torch.ops.radixserve_cpu.rotary(x, cos, sin)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[rows, vocab]`` logits (first maximum, NaN counting as the
    maximum): two vectorised passes per row for bf16 and float32, torch's argmax otherwise."""
    return torch.ops.radixserve_cpu.argmax(logits)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the float32 or bf16 ``logits`` of the tokens ``bitmask`` forbids to ``-inf`` in
    ``rows``, in place (the bitmask as ``constrained/base.py`` defines it): masked stores of a
    whole word of the bitmask at once."""
    torch.ops.radixserve_cpu.apply_token_bitmask(logits, bitmask, rows)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [..., gate | up]``, in one kernel (torch: two, and an
    intermediate as large as the output)."""
    return torch.ops.radixserve_cpu.silu_and_mul(x.contiguous())


ATTENTION_MAX_HEAD_DIM = 256


# quantized KV pools the attention kernels read (``csrc/kv_quant.h``), beside KERNEL_DTYPES
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def attention_kernels_support(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the attention kernels cannot take a KV pool of ``dtype`` with ``head_dim``, or None
    when they can (head_dim a multiple of 16 up to 256, float32, bf16, or int8/fp8 codes with
    scales; any GQA group)."""
    if not has_ops(
        "decode_attention", "extend_attention", "decode_attention_quant", "extend_attention_quant"
    ):
        return "radixserve's CPU attention kernels do not run on this machine"
    if dtype not in KERNEL_DTYPES + QUANTIZED_KV_DTYPES:
        return (
            "the CPU attention kernels take float32, bfloat16, int8, float8_e4m3fn or "
            f"float8_e5m2, not {dtype}"
        )
    if head_dim % 16 or head_dim > ATTENTION_MAX_HEAD_DIM:
        return (
            "the CPU attention kernels take a head_dim that is a multiple of 16 up to 256, "
            f"not {head_dim}"
        )
    return None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    extend_lens: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write the new tokens' K/V (``[tokens, kv_heads, head_dim]``) at ``loc`` and attend over
    each request's ``seq_lens`` slots in ``req_to_token``; returns ``[tokens, heads, head_dim]``
    for ``q`` of that shape. Without ``extend_lens``, one decode token per request (the decode
    kernel); with them, a prefill: each request's ``extend_lens`` new tokens (the last of its
    ``seq_lens``) attend causally (the extend kernel). ``window``: each query sees only the
    last ``window`` positions up to itself (sliding-window attention); ``softcap`` > 0: scaled
    scores are soft-capped to ``softcap * tanh(s / softcap)``."""
    win = window or 0
    if extend_lens is None:
        out = torch.empty_like(q)
        torch.ops.radixserve_cpu.decode_attention(
            q, k, v, loc, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale, win,
            softcap, out,
        )
        return out
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.radixserve_cpu.extend_attention(
        q, k, v, loc, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_lens,
        scale, win, softcap, out,
    )
    return out


def paged_attention_quant(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    extend_lens: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    bf16_query: bool = False,
) -> torch.Tensor:
    """``paged_attention`` over a quantized pool (int8/fp8 codes, float32 scales ``[slots,
    kv_heads]``, contiguous or one value broadcast with strides 0) whose new tokens' K/V the
    caller has quantized into it already; ``q`` float32, returns float32. ``window`` and
    ``softcap`` as in ``paged_attention`` (the same kernels).
    ``bf16_query`` (``q`` holds bf16 values, a bf16 model's queries): decode scores int8 keys
    against the query quantised to int16 (finer than bf16), with VNNI's exact integer products,
    and fp8 keys as bf16 against the bf16 query (exact products, AVX512-BF16 dot products)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    args = (q, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices, seq_lens)
    win = window or 0
    if extend_lens is None:
        torch.ops.radixserve_cpu.decode_attention_quant(
            *args, scale, win, softcap, out, bf16_query
        )
    else:
        torch.ops.radixserve_cpu.extend_attention_quant(
            *args, extend_lens, scale, win, softcap, out
        )
    return out
