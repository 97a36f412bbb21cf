"""The ``triton`` attention backend's kernels, run by Triton's interpreter on CPU, against the
``torch_native`` reference backend on random batches: prefix and new-token lengths, page tables
(shuffled pages, rows out of order), GQA groups, head sizes 64 and 128 (and 80), fp32 and fp16.

``TRITON_INTERPRET=1`` is set before the kernels' module is first imported (``triton.jit`` reads
it when a kernel is defined). bf16 is not tested here: the interpreter computes it wrongly; the
GPU check (``tests/cuda/``) covers it.
"""

from __future__ import annotations

import os

import torch

# Only where no GPU runs the compiled kernels: the variable stays set for the whole test session
# (and the servers it starts), which on a GPU machine would interpret tests/cuda's kernels too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from radixserve.forward_batch import ForwardMode  # noqa: E402
from radixserve.layers.attention import create_attention_backend  # noqa: E402
from radixserve.mem_cache.kv_pool import MHATokenToKVPool  # noqa: E402
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool  # noqa: E402
from tests.layers.paged_batches import attend, random_batch  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}

CASES = [  # (seed, mode, page_size, dtype, heads, kv_heads, head_dim)
    (0, ForwardMode.DECODE, 1, torch.float32, 4, 2, 64),
    (1, ForwardMode.DECODE, 4, torch.float16, 4, 1, 64),
    (2, ForwardMode.DECODE, 16, torch.float32, 2, 2, 128),
    (3, ForwardMode.EXTEND, 1, torch.float32, 4, 2, 64),
    (4, ForwardMode.EXTEND, 4, torch.float16, 4, 1, 64),
    (5, ForwardMode.EXTEND, 8, torch.float32, 2, 1, 128),
    (6, ForwardMode.EXTEND, 2, torch.float16, 2, 2, 80),  # head_dim not a power of two
]


@pytest.mark.parametrize(("seed", "mode", "page_size", "dtype", "heads", "kv_heads", "head_dim"),
                         CASES)
def test_triton_matches_torch_native(seed, mode, page_size, dtype, heads, kv_heads, head_dim):
    batch = random_batch(seed, mode, page_size, dtype, heads, kv_heads, head_dim)
    # The GPU's 8 KV splits once, the interpreter's default (2) otherwise.
    out = attend("triton", batch, kv_splits=8 if seed == 0 else None)
    fb = batch.fb
    assert torch.equal(batch.pool.get_key_buffer(0)[fb.out_cache_loc],
                       batch.k.view(-1, kv_heads, head_dim))  # new K written
    expected = attend("torch_native", batch)
    assert out.dtype == dtype and out.shape == expected.shape
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_extend_over_several_query_and_key_blocks():
    """New tokens longer than one query block (32 in fp32), after a cached prefix."""
    batch = random_batch(11, ForwardMode.EXTEND, 1, torch.float32, 2, 1, 64, max_extend=40)
    assert max(batch.fb.extend_seq_lens_cpu) > 32
    torch.testing.assert_close(attend("triton", batch), attend("torch_native", batch),
                               atol=2e-5, rtol=2e-5)


def test_kernels_are_interpreted():
    """The module-level switch took effect: the kernels run in Triton's interpreter here."""
    from triton.runtime.interpreter import InterpretedFunction

    from radixserve.layers.attention import triton_kernels

    assert isinstance(triton_kernels._decode_stage1, InterpretedFunction)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pool = MHATokenToKVPool(8, 1, torch.float32, 1, 64, 1, "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        create_attention_backend("triton", ReqToTokenPool(2, 8, "cpu"), pool)
