"""What the layer tests share: whether the CPU kernels run here, bf16 comparisons, inputs."""

from __future__ import annotations

import pytest
import torch

from radixserve import envs
from radixserve.layers.cpu_kernels import _cpu_flags, load_cpu_kernels

# the kernels run here: the CPU has the instructions and RADIXSERVE_DISABLE_CPU_KERNELS is unset
HAS_KERNELS = {"avx512f", "avx512bw"} <= _cpu_flags() and (
    not envs.RADIXSERVE_DISABLE_CPU_KERNELS.get()
)
HAS_AMX = HAS_KERNELS and {"amx_tile", "amx_bf16"} <= _cpu_flags()


def kernels_here() -> bool:
    """Load the kernels (whichever test runs first); they load exactly where the CPU has
    AVX-512 F/BW, and elsewhere ops keep to torch."""
    assert load_cpu_kernels() == HAS_KERNELS
    return HAS_KERNELS


def require_kernels() -> None:
    """Skip the calling test where the kernels do not run: a kernel test that found nothing to
    test must show as skipped, not passed."""
    if not kernels_here():
        pytest.skip("needs radixserve's CPU kernels (AVX-512 F and BW, not disabled)")


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
