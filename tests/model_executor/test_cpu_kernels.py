"""radixserve's small-batch bf16 linear kernels: built where the CPU has AVX512-BF16, equal to a
float64 reference up to bf16 rounding, taken by linear layers and the LM head for batches they
cover (one row for the GEMV, up to 32 on AMX) and by nothing larger. On a CPU without the
instruction sets every layer keeps to oneDNN, which these tests check too."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.cpu_kernels import (
    AMX_MAX_ROWS,
    BlockedWeight,
    _cpu_flags,
    gemv,
    load_cpu_kernels,
    small_gemm_amx,
)
from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear, mkldnn_linear
from radixserve.model_executor import model_runner
from tests.model_executor.harness import ManualSlots, make_runner

HAS_BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags()
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
