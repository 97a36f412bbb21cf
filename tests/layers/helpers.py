"""What the layer tests share: whether the CPU kernels run here, bf16 comparisons, inputs."""

from __future__ import annotations

import pytest
import torch

from radixserve import envs
from radixserve.layers.cpu_kernels import _cpu_flags, load_cpu_kernels

_FLAGS = _cpu_flags()  # as the kernels are built (RADIXSERVE_CPU_KERNELS_AVX2 hides AVX-512)
_ENABLED = not envs.RADIXSERVE_DISABLE_CPU_KERNELS.get()
# all the kernels run here: the CPU has AVX-512 F/BW and RADIXSERVE_DISABLE_CPU_KERNELS is unset
HAS_KERNELS = {"avx512f", "avx512bw"} <= _FLAGS and _ENABLED
# the linear kernel runs here: that, or the AVX2 build (csrc/avx2/) on a CPU with AVX2 and FMA
HAS_LINEAR_KERNEL = HAS_KERNELS or ({"avx2", "fma"} <= _FLAGS and _ENABLED)
HAS_AMX = HAS_KERNELS and {"amx_tile", "amx_bf16"} <= _FLAGS
# the ops the AVX2 build registers (csrc/avx2/): the linear kernels (float and int8) and the
# elementwise ones
AVX2_OPS = frozenset({"linear", "linear_int8", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
                      "rotary", "argmax"})


# for tests that ask for what only the AVX-512 kernels provide by name: the `cpu` attention
# backend (and so CPU graphs), the LoRA and 4-bit kernels
_NEEDS_KERNELS = "needs radixserve's CPU kernels (AVX-512 F and BW, not disabled)"
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason=_NEEDS_KERNELS)


def kernels_here() -> bool:
    """Load the kernels (whichever test runs first); whether all of them run here. They load
    where the CPU has AVX-512 F/BW (all of them) or AVX2 and FMA (``AVX2_OPS``), and elsewhere
    ops keep to torch."""
    assert load_cpu_kernels() == HAS_LINEAR_KERNEL
    return HAS_KERNELS


def linear_kernel_here() -> bool:
    """Load the kernels; whether the linear kernel runs here (all builds have it)."""
    return ops_here("linear")


def require_kernels() -> None:
    """Skip the calling test where the kernels do not run: a kernel test that found nothing to
    test must show as skipped, not passed."""
    if not kernels_here():
        pytest.skip(_NEEDS_KERNELS)


def ops_here(*names: str) -> bool:
    """Load the kernels; whether the ops ``names`` run here: all of them where the AVX-512
    kernels do, those of ``AVX2_OPS`` where the AVX2 build does."""
    kernels_here()
    return HAS_KERNELS or (HAS_LINEAR_KERNEL and set(names) <= AVX2_OPS)


def require_ops(*names: str) -> None:
    """Skip the calling test where the kernels ``names`` do not run (see ``ops_here``)."""
    if not ops_here(*names):
        pytest.skip(f"needs radixserve's CPU kernels {', '.join(names)}")


def require_linear_kernel() -> None:
    """Skip the calling test where no build of the linear kernel runs (neither AVX-512 F/BW
    nor AVX2 and FMA, or disabled)."""
    require_ops("linear")


def bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the output (and of float32 sums in another order)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2**-7, atol=1e-3 * scale)


def assert_bf16_equal_but_for_ties(actual: torch.Tensor, expected: torch.Tensor,
                                   steps: int = 1) -> None:
    """Equal but for a rare element ``steps`` bf16 values away: a float32 result an ulp from the
    reference's that rounds to the other side of a bf16 tie (one step before the norm's weight
    is two after it). Same-sign bf16 values are as many steps apart as their bit patterns."""
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    apart = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert apart.max() <= steps and apart.count_nonzero() <= max(1, actual.numel() // 1000)


def bf16_inputs(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two bf16 activations of ``shape`` and a weight for its last dimension (around 1)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = (3 * torch.randn(2, *shape, generator=gen)).to(torch.bfloat16)
    weight = (0.5 + torch.rand(shape[-1], generator=gen)).to(torch.bfloat16)
    return x, y, weight
