"""The batched LoRA op: the CPU path (rows grouped by adapter) equals the native reference, and
both equal a per-row loop written out here, for batches mixing adapters and base rows."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.custom_op import OpImpl, build_context
from radixserve.layers.lora import LoRABatchInfo, LoRADelta
from tests.layers.helpers import needs_kernels


def _expected(x, a, b, slots):
    rows = []
    for t, s in enumerate(slots.tolist()):
        rows.append(torch.zeros(b.shape[1]) if s < 0 else b[s] @ (a[s] @ x[t]))
    return torch.stack(rows)


@pytest.mark.parametrize("slots", [
    [0, 0, 0, -1, -1, 2, 2, 1],  # contiguous runs (one request each)
    [1, -1, 0, 1, 2, 0, -1, 1],  # interleaved (decode rows of many requests)
    [-1, -1, -1, -1, -1, -1, -1, -1],  # the base model only
])
def test_cpu_and_native_equal_the_per_row_reference(slots):
    torch.manual_seed(0)
    x, a, b = torch.randn(8, 16), torch.randn(3, 6, 16), torch.randn(3, 10, 6)
    info = LoRABatchInfo.from_token_slots(torch.tensor(slots))
    with build_context("cpu", torch.float32):
        op = LoRADelta()
    expected = _expected(x, a, b, torch.tensor(slots))
    torch.testing.assert_close(op.forward_native(x, a, b, info), expected)
    torch.testing.assert_close(op.forward_cpu(x, a, b, info), expected)
    assert op.impl in (OpImpl.CPU, OpImpl.NATIVE)


def test_groups_are_slices_for_runs_and_indices_otherwise():
    info = LoRABatchInfo.from_token_slots(torch.tensor([0, 0, 1, -1, 1]))
    groups = dict(info.groups)
    assert groups[0] == slice(0, 2)
    assert groups[1].tolist() == [2, 4]
    assert not LoRABatchInfo.from_token_slots(torch.tensor([-1, -1])).any_adapter


def test_half_precision_rows_with_float32_weights_return_the_rows_dtype():
    """On CPU the pool is float32 under a bf16 model: the delta comes back in bf16."""
    torch.manual_seed(1)
    x, a, b = torch.randn(5, 16), torch.randn(2, 4, 16), torch.randn(2, 8, 4)
    info = LoRABatchInfo.from_token_slots(torch.tensor([0, 1, -1, 1, 0]))
    with build_context("cpu", torch.bfloat16):
        op = LoRADelta()
    expected = _expected(x.bfloat16().float(), a, b, info.token_slots)
    for impl in (op.forward_native, op.forward_cpu):
        out = impl(x.bfloat16(), a, b, info)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("slots", [[0, 0, 0, -1, 1, 1], [2, 2, 2, 2], [1, -1, 0, 1]])
def test_a_row_parallel_split_summed_between_shrink_and_expand_gives_the_whole_delta(slots):
    """What a tensor-parallel rank of a row-parallel layer computes: its half of x and of A's
    columns, the rank-sized intermediate summed with the other rank's (``reduce``), then the
    whole B: the full layer's delta, on every path (one adapter, several, base rows)."""
    torch.manual_seed(2)
    x, a, b = torch.randn(len(slots), 16), torch.randn(3, 6, 16), torch.randn(3, 10, 6)
    info = LoRABatchInfo.from_token_slots(torch.tensor(slots))
    with build_context("cpu", torch.float32):
        op = LoRADelta()
    expected = _expected(x, a, b, torch.tensor(slots))
    for impl in (op.forward_native, op.forward_cpu):
        assert_two_ranks_sum_to(impl, x, a, b, info, expected)


def assert_two_ranks_sum_to(impl, x, a, b, info, expected, **tol):
    """Rank 1 runs on the second half of the input features and keeps its intermediate; rank 0
    runs on the first half, its ``reduce`` adding rank 1's (what the all-reduce does)."""
    half = x.shape[1] // 2
    kept = []
    impl(x[:, half:].contiguous(), a[:, :, half:].contiguous(), b, info,
         lambda xa: kept.append(xa.clone()) or xa)
    got = impl(x[:, :half].contiguous(), a[:, :, :half].contiguous(), b, info,
               lambda xa: xa + kept[0])
    assert len(kept) == 1
    torch.testing.assert_close(got, expected, **tol)


@needs_kernels  # the LoRA kernel (lora_add_), an AVX-512 one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [
    [1, -1, 0, 1, 2, 0, -1, 1, 1, 1, 1, 2],  # a decode: interleaved, a slot of five rows
    [0] * 9 + [-1] * 3 + [2] * 3,  # contiguous runs, a partial tile
    [-1, -1, -1],  # the base model only: nothing changes
])
def test_the_fused_cpu_kernel_adds_the_reference_delta_in_place(dtype, slots):
    """``add_to`` on CPU (one kernel, tiles of rows of one adapter, block-diagonal B) against
    the reference; widths that are not multiples of a register, and the kernel's copies of the
    weights rebuilt when the pool's version changes. A bf16 model's copies are bf16: the
    reference then takes the weights rounded to bf16, and the output is within its rounding."""
    gen = torch.Generator().manual_seed(len(slots))
    rows, k, n, width = len(slots), 37, 70, 6  # two shards of rank 3: ranks 0-2 → cols 0-39
    x = torch.randn(rows, k, generator=gen).to(dtype)
    a = torch.randn(3, width, k, generator=gen)
    b = torch.zeros(3, n, width)
    b[:, :40, :3] = torch.randn(3, 40, 3, generator=gen)
    b[:, 40:, 3:] = torch.randn(3, 30, 3, generator=gen)
    blocks = torch.tensor([[0, 3, 0, 40], [3, 6, 40, 70]])
    info = LoRABatchInfo.from_token_slots(torch.tensor(slots), weights_version=1)
    with build_context("cpu", dtype):
        op = LoRADelta()
    assert op.impl is OpImpl.CPU
    base = torch.randn(rows, n, generator=gen).to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.07, "rtol": 0.01}
    for version in (1, 2):
        info.weights_version = version
        a_w, b_w = a.to(dtype).float(), b.to(dtype).float()
        want = base.float() + _expected(x.float(), a_w, b_w, torch.tensor(slots))
        out = base.clone()
        assert op.add_to(out, x, a, b, info, blocks=blocks) is out
        torch.testing.assert_close(out.float(), want, **tol)
        assert torch.equal(out[torch.tensor(slots) < 0], base[torch.tensor(slots) < 0])
        b[0] *= 2  # the pool writes a slot: a new version, the copies are rebuilt


@needs_kernels  # the LoRA kernel (lora_add_), an AVX-512 one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runs", [True, False], ids=["runs", "interleaved"])
def test_a_prefill_adds_in_place_the_same_bits_as_adding_the_cpu_delta(dtype, runs):
    """Past the decode kernel's rows ``add_to`` adds each adapter's delta into ``out`` in
    place (no zero-filled float32 buffer of the batch): in float32 the same bits as
    ``out.add_(forward_cpu(...))``; in bf16 (matmuls per run of rows, or per adapter's
    gathered rows when interleaved) the reference within bf16's rounding; rows of no adapter
    untouched."""
    from radixserve.layers.lora.lora_op import SMALL_BATCH_ROWS

    gen = torch.Generator().manual_seed(7)
    rows = SMALL_BATCH_ROWS + 36
    slots = (torch.arange(rows) * 3 // rows) if runs else torch.arange(rows) % 3
    slots = torch.where(torch.arange(rows) % 11 == 5, -1, slots) if not runs else slots
    if runs:
        slots[40:50] = -1  # a request on the base model between two adapters' runs
    x = torch.randn(rows, 24, generator=gen).to(dtype)
    a, b = torch.randn(3, 4, 24, generator=gen), torch.randn(3, 18, 4, generator=gen)
    info = LoRABatchInfo.from_token_slots(slots)
    assert any(isinstance(r, slice) for _, r in info.groups) == runs
    with build_context("cpu", dtype):
        op = LoRADelta()
    base = torch.randn(rows, 18, generator=gen).to(dtype)
    want = base.clone().add_(op.forward_cpu(x, a, b, info))
    out = base.clone()
    assert op.add_to(out, x, a, b, info) is out
    if dtype == torch.float32:
        assert torch.equal(out, want)
    else:  # bf16: ``_add_bf16`` on the weights rounded to bf16, within bf16's rounding
        want = base.float() + _expected(x.float(), a.bfloat16().float(), b.bfloat16().float(),
                                        slots)
        torch.testing.assert_close(out.float(), want, atol=0.15, rtol=0.02)
    assert torch.equal(out[slots < 0], base[slots < 0])


@needs_kernels
@pytest.mark.parametrize("runs", [True, False], ids=["runs", "interleaved"])
def test_a_bf16_prefill_skips_the_zero_blocks_of_a_wide_fused_layer(runs):
    """A fused layer whose shards are at least ``WIDE_BLOCK_COLS`` wide (gate_up): a bf16
    prefill expands block by block, so B's zero blocks are never read; the result is the
    reference's within bf16 rounding, and garbage written into the zero blocks of the kernel's
    copy would show if they were read."""
    from radixserve.layers.lora.lora_op import SMALL_BATCH_ROWS, WIDE_BLOCK_COLS

    gen = torch.Generator().manual_seed(11)
    rows, k, n, rank = SMALL_BATCH_ROWS + 40, 32, 2 * WIDE_BLOCK_COLS, 3
    slots = torch.arange(rows) * 2 // rows if runs else torch.arange(rows) % 2
    x = torch.randn(rows, k, generator=gen).bfloat16()
    a = torch.randn(2, 2 * rank, k, generator=gen)
    b = torch.zeros(2, n, 2 * rank)
    half = WIDE_BLOCK_COLS
    b[:, :half, :rank] = torch.randn(2, half, rank, generator=gen)
    b[:, half:, rank:] = torch.randn(2, half, rank, generator=gen)
    blocks = torch.tensor([[0, rank, 0, half], [rank, 2 * rank, half, n]])
    info = LoRABatchInfo.from_token_slots(slots, weights_version=1)
    with build_context("cpu", torch.bfloat16):
        op = LoRADelta()
    _, bt_k = op._kernel_weights(a, b, info, torch.bfloat16)
    bt_k[:, :rank, half:] = 1e4  # the zero blocks: never read on this path
    bt_k[:, rank:, :half] = 1e4
    base = torch.randn(rows, n, generator=gen).bfloat16()
    out = base.clone()
    assert op.add_to(out, x, a, b, info, blocks=blocks) is out
    want = base.float() + _expected(x.float(), a.bfloat16().float(), b.bfloat16().float(), slots)
    torch.testing.assert_close(out.float(), want, atol=0.15, rtol=0.02)
