"""The Triton kernels behind ``LoRADelta.forward_cuda``, run by Triton's interpreter on CPU
against the native reference: batches mixing adapters, base rows, runs longer than a block, and
ranks below the dot's minimum block, in fp32 and fp16 (the interpreter computes bf16 wrongly; the
GPU check covers it)."""

from __future__ import annotations

import os

import torch

# Only where no GPU runs the compiled kernels (see test_triton_ops.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from radixserve.layers.custom_op import build_context  # noqa: E402
from radixserve.layers.lora import LoRABatchInfo, LoRADelta  # noqa: E402
from tests.layers.test_lora_op import assert_two_ranks_sum_to  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


def test_segments_are_runs_of_one_adapter():
    info = LoRABatchInfo.from_token_slots(torch.tensor([0, 0, -1, 1, 1, 1, 0, -1, -1, 2]))
    assert info.seg_starts.tolist() == [0, 3, 6, 9]
    assert info.seg_lens.tolist() == [2, 3, 1, 1]
    assert info.seg_slots.tolist() == [0, 1, 0, 2]
    assert info.max_seg_len == 3
    empty = LoRABatchInfo.from_token_slots(torch.tensor([-1, -1]))
    assert empty.seg_starts.numel() == 0 and empty.max_seg_len == 0


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("slots", [
    [0] * 20 + [-1] * 3 + [2] * 5 + [1] * 2,  # an extend: a run longer than a 16-row block
    [1, -1, 0, 1, 2, 0, -1, 1],  # a decode: interleaved adapters and base rows
    [-1, -1, -1],  # the base model only
])
@pytest.mark.parametrize(("rank", "in_features", "out_features"), [(4, 48, 80), (16, 130, 20)])
def test_triton_delta_matches_native(dtype, tol, slots, rank, in_features, out_features):
    gen = torch.Generator().manual_seed(len(slots) + rank)
    rows = len(slots)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    a = (torch.randn(3, rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(3, out_features, rank, generator=gen).to(dtype)
    info = LoRABatchInfo.from_token_slots(torch.tensor(slots))
    with build_context("cpu", dtype):
        op = LoRADelta()
    got = op.forward_cuda(x, a, b, info)
    want = op.forward_native(x, a, b, info)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert bool((got[torch.tensor(slots) < 0] == 0).all())


def test_triton_delta_sums_the_intermediate_before_the_expand():
    """The row-parallel split of test_lora_op.py on the Triton path."""
    slots = [0, 0, -1, 1, 1, 2]
    gen = torch.Generator().manual_seed(5)
    x, a, b = (torch.randn(6, 32, generator=gen), torch.randn(3, 4, 32, generator=gen),
               torch.randn(3, 24, 4, generator=gen))
    info = LoRABatchInfo.from_token_slots(torch.tensor(slots))
    with build_context("cpu", torch.float32):
        op = LoRADelta()

    assert_two_ranks_sum_to(op.forward_cuda, x, a, b, info, op.forward_native(x, a, b, info),
                            atol=1e-5, rtol=1e-5)


def test_one_segment_per_row_as_in_a_cuda_graph_matches_native():
    """A graph's decode step (``lora/graph_inputs.py``): a segment per row, base and padding
    rows of length 0 with slot -1; the kernels read nothing else from the slots."""
    from radixserve.lora.graph_inputs import LoRAGraphInputs

    gen = torch.Generator().manual_seed(9)
    x, a, b = (torch.randn(8, 40, generator=gen), torch.randn(3, 4, 40, generator=gen),
               torch.randn(3, 24, 4, generator=gen))
    inputs = LoRAGraphInputs(8, "cpu")
    with build_context("cpu", torch.float32):
        op = LoRADelta()
    inputs.write([2, -1, 0, 2, 1], bs=5, padded=8)
    info = inputs.info(8)
    want = op.forward_native(x, a, b, LoRABatchInfo.from_token_slots(inputs.token_slots))
    torch.testing.assert_close(op.forward_cuda(x, a, b, info), want, atol=1e-5, rtol=1e-5)
    assert bool((op.forward_cuda(x, a, b, info)[5:] == 0).all())
    inputs.write([-1, 1], bs=2, padded=8)  # the same buffers, new values: no new grid
    want = op.forward_native(x, a, b, LoRABatchInfo.from_token_slots(inputs.token_slots))
    torch.testing.assert_close(op.forward_cuda(x, a, b, info), want, atol=1e-5, rtol=1e-5)
