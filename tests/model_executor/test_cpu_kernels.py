"""radixserve's batch-1 bf16 GEMV kernel: built where the CPU has AVX512-BF16, equal to a float64
reference up to bf16 rounding, and taken by linear layers and the LM head for one-row inputs only.
On a CPU without the instruction set every layer keeps to oneDNN, which these tests check too."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.cpu_kernels import _cpu_flags, gemv, load_cpu_kernels, pack_gemv_weight
from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear
from radixserve.model_executor import model_runner
from tests.model_executor.harness import ManualSlots, make_runner

HAS_BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags()


def bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the output (and of float32 sums in another order)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2**-7, atol=1e-3 * scale)


def test_kernels_build_exactly_where_the_cpu_supports_them():
    assert load_cpu_kernels() == HAS_BF16


@pytest.mark.parametrize("n, k, bias", [(48, 70, True), (1152, 896, True), (896, 4864, False)])
def test_gemv_equals_a_float64_reference_up_to_bf16_rounding(n, k, bias):
    if not HAS_BF16:
        assert not load_cpu_kernels()  # nothing to run here: layers use oneDNN
        return
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    reference = x.double() @ w.double().T + (b.double() if bias else 0)
    out = gemv(x, pack_gemv_weight(w), b)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    bf16_close(out, reference)


@pytest.mark.parametrize("layer", [
    RowParallelLinear(96, 48, bias=True),
    QKVParallelLinear(64, 16, 4, 2, bias=True),
])
def test_linear_layer_takes_the_kernel_for_one_row_and_onednn_for_more(layer):
    gen = torch.Generator().manual_seed(0)
    layer.weight.data = torch.randn(layer.weight.shape, generator=gen).to(torch.bfloat16)
    layer.bias.data = torch.randn(layer.bias.shape, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, layer.weight.shape[1], generator=gen).to(torch.bfloat16)
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    layer.prepack(gemv=True)
    assert (layer.gemv_weight is not None) == HAS_BF16 and layer.prepacked
    bf16_close(layer(x[:1]), reference[:1])  # the kernel (where supported)
    bf16_close(layer(x), reference)  # oneDNN


def test_bf16_runner_decodes_one_request_alike_with_and_without_the_kernel(llama_path,
                                                                          monkeypatch):
    def decode_logits() -> tuple[torch.Tensor, bool]:
        runner = make_runner(llama_path, dtype="bfloat16")
        slots = ManualSlots(runner)
        seq = slots.new_seq()
        runner.forward(slots.extend([seq], [[5, 9, 30, 41, 7, 100]]))
        used = runner.model.lm_head.gemv_weight is not None
        return runner.forward(slots.decode([seq], [3])).float(), used

    with_kernel, used = decode_logits()
    assert used == HAS_BF16
    monkeypatch.setattr(model_runner, "GEMV_COPY_MAX_RAM_FRACTION", 0.0)  # no room for copies
    without, used = decode_logits()
    assert not used
    torch.testing.assert_close(with_kernel, without, atol=0.05, rtol=0.05)
