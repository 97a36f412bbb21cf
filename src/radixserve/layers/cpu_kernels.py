"""radixserve's own CPU kernels (``layers/csrc``), compiled on first use, once per machine.

- linear layers for small batches (``csrc/linear_bf16.cpp``): decode steps of up to 32 requests
  read each weight once for a few rows, and these kernels stream it at memory speed where oneDNN
  reaches 60-70% of it (RESULTS.md). They share one blocked copy of the weight: a GEMV for one
  row (AVX512-BF16) and an AMX kernel for up to 32 rows (where the CPU has AMX and K is a
  multiple of 32);
- fused bf16 RMSNorm, residual add + RMSNorm, SiluAndMul and the rotary embedding, and the
  greedy argmax of bf16 or float32 logits (``csrc/elementwise_bf16.cpp``): one kernel each where
  torch runs up to nine, whose start-up costs dominate a decode step's small tensors. They round
  to bf16 where transformers' bf16 modules do;
- decode attention straight from the paged KV pool (``csrc/decode_attention.cpp``, float32 and
  bf16): one call per layer writes the new K/V and attends, where the torch path runs two
  index_puts, two gathers, a mask and SDPA.

Nothing asks on every call whether they run: each op picks them once, when the model is built
(``layers/custom_op.py``), weights are packed for them once, after loading
(``layers/packed_weight.py``), and the ``cpu`` attention backend calls the attention kernel.

They need AVX512-BF16. The build goes through ``torch.utils.cpp_extension`` (ninja and g++,
about 20 s) into ``~/.cache/radixserve/kernels/<key>``; the key covers the sources, the torch
version and this CPU's flags (the code is built for the CPU it runs on), so later starts load
the cached library at once. Builds are serialised by an ``fcntl`` lock on ``<key>.lock``, which
the kernel releases when its holder dies, and compile in a scratch directory of their own: a
build killed half-way leaves nothing that later starts wait on. Without a compiler or the
instruction set, or with ``RADIXSERVE_DISABLE_CPU_KERNELS=1``, ``load_cpu_kernels`` returns False
and ops are built with their torch implementations.
"""

from __future__ import annotations

import contextlib
import fcntl
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

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
LIBRARY_NAME = "radixserve_cpu_kernels"
BLOCK_ROWS = 16  # output rows per weight block (csrc/linear_bf16.cpp)
AMX_MAX_ROWS = 32  # input rows the AMX kernel takes (two tiles of 16)
AMX_K_MULTIPLE = 32  # inputs per AMX tile row


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _build_dir(flags: set[str]) -> Path:
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(sorted(flags)).encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "radixserve" / "kernels" / key.hexdigest()[:16]


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


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir`` against other processes: an ``fcntl`` lock, which the kernel drops
    when its holder dies, so a build killed half-way never blocks the next one."""
    with open(build_dir.with_suffix(".lock"), "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


def _build_and_load(build_dir: Path, library: Path) -> None:
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
            sources=[str(s) for s in SOURCES],
            # -fopenmp: at::parallel_for runs on torch's own OpenMP threads (same libgomp)
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=scratch,
            is_python_module=False,
        )
        os.replace(Path(scratch) / f"{LIBRARY_NAME}.so", library)


@functools.cache
def load_cpu_kernels() -> bool:
    """Register ``torch.ops.radixserve_cpu.*``; False when they cannot run here."""
    if envs.RADIXSERVE_DISABLE_CPU_KERNELS.get():
        return False
    flags = _cpu_flags()
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        return False
    try:
        build_dir = _build_dir(flags)
        build_dir.mkdir(parents=True, exist_ok=True)
        library = build_dir / f"{LIBRARY_NAME}.so"
        with _exclusive(build_dir):
            # no other builder is alive: scratch directories are what killed builds left
            for leftover in build_dir.parent.glob(f"{build_dir.name}.build-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            if library.exists():
                torch.ops.load_library(str(library))
            else:
                _build_and_load(build_dir, library)
    except Exception as e:  # no compiler, no ninja, a failed build: oneDNN still works
        logger.warning("radixserve's CPU kernels are unavailable, using oneDNN only: %s", e)
        return False
    return True


def blocked_weight_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([N, K] bf16 on CPU) can take the small-batch kernels here."""
    n, k = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and n % BLOCK_ROWS == 0
        and k % 2 == 0
        and load_cpu_kernels()
    )


@functools.cache
def amx_available() -> bool:
    """Whether this CPU has AMX for bf16, the kernels load, and Linux grants this process the
    tile state (it must be asked for; kernels before 5.16 cannot)."""
    return (
        {"amx_tile", "amx_bf16"} <= _cpu_flags()
        and load_cpu_kernels()
        and torch.ops.radixserve_cpu.amx_permitted()
    )


def gemv(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one row ``x`` ([1, K] bf16) and a blocked weight."""
    return torch.ops.radixserve_cpu.gemv_bf16(x.contiguous(), packed, bias)


def small_gemm_amx(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for up to 32 rows on AMX (K a multiple of 32)."""
    return torch.ops.radixserve_cpu.small_gemm_amx_bf16(x.contiguous(), packed, bias)


@dataclass(frozen=True)
class BlockedWeight:
    """A linear weight's blocked copy for the small-batch kernels. ``max_rows``: the most input
    rows they take for it (32 on AMX, else 1 for the GEMV); larger batches go to oneDNN."""

    packed: torch.Tensor
    max_rows: int
    amx: bool

    @classmethod
    def of(cls, weight: torch.Tensor) -> BlockedWeight | None:
        """The copy of ``weight`` ([N, K]), or None where the kernels cannot take it."""
        if not blocked_weight_supported(weight):
            return None
        n, k = weight.shape
        packed = weight.detach().view(n // BLOCK_ROWS, BLOCK_ROWS, k // 2, 2).permute(0, 2, 1, 3)
        amx = amx_available() and k % AMX_K_MULTIPLE == 0
        return cls(
            packed.clone(memory_format=torch.contiguous_format), AMX_MAX_ROWS if amx else 1, amx
        )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for at most ``max_rows`` rows of ``x``. AMX takes even
        one row where it runs: with its prefetch it streams faster than the GEMV."""
        if self.amx:
            return small_gemm_amx(x, self.packed, bias)
        return gemv(x, self.packed, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' bf16 RMSNorm over the last dimension of ``x`` in one pass per row (torch
    runs eight kernels); a non-contiguous ``x`` (Qwen3's per-head q/k views) is copied first."""
    return torch.ops.radixserve_cpu.rms_norm_bf16(x.contiguous(), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual)``: one kernel for the
    residual add and the next norm (torch: nine). Both must be contiguous, of one shape."""
    torch.ops.radixserve_cpu.fused_add_rms_norm_bf16(x, residual, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in one kernel (torch: four), rounding as torch's bf16
    ops do; ``x`` ``[n, heads, head_dim]`` may be a row-strided view of the qkv output."""
    return torch.ops.radixserve_cpu.rotary_bf16(x, cos, sin)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[rows, vocab]`` logits (first maximum, NaN counting as the
    maximum): two vectorised passes per row for bf16 and float32, torch's argmax otherwise."""
    return torch.ops.radixserve_cpu.argmax(logits)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [..., gate | up]``, in one kernel (torch: two, and an
    intermediate as large as the output)."""
    return torch.ops.radixserve_cpu.silu_and_mul_bf16(x.contiguous())


ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
ATTENTION_MAX_HEAD_DIM = 256


def attention_kernels_support(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the attention kernels cannot take a KV pool of ``dtype`` with ``head_dim``, or None
    when they can (head_dim a multiple of 16 up to 256, float32 or bf16, any GQA group)."""
    if not load_cpu_kernels():
        return "radixserve's CPU kernels do not run on this machine"
    if dtype not in ATTENTION_DTYPES:
        return f"the CPU attention kernels take float32 or bfloat16, not {dtype}"
    if head_dim % 16 or head_dim > ATTENTION_MAX_HEAD_DIM:
        return (
            "the CPU attention kernels take a head_dim that is a multiple of 16 up to 256, "
            f"not {head_dim}"
        )
    return None


def decode_attention(
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
) -> torch.Tensor:
    """One decode token per request: write its K/V (``[bs, kv_heads, head_dim]``) at ``loc`` and
    attend over the request's ``seq_lens`` slots in ``req_to_token``; returns ``[bs, heads,
    head_dim]`` for ``q`` of that shape."""
    out = torch.empty_like(q)
    torch.ops.radixserve_cpu.decode_attention(
        q, k, v, loc, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale, out
    )
    return out
