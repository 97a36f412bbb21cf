"""The ``triton`` attention backend's kernels, run by Triton's interpreter on CPU, against the
``torch_native`` reference backend on random batches: prefix and new-token lengths, page tables
(shuffled pages, rows out of order), GQA groups, head sizes 64 and 128, fp32 and fp16.

``TRITON_INTERPRET=1`` is set before the kernels' module is first imported (``triton.jit`` reads
it when a kernel is defined). bf16 is not tested here: the interpreter computes it wrongly; the
GPU check (``tests/cuda/``) covers it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.layers.attention import Attention, create_attention_backend  # noqa: E402
from radixserve.mem_cache.kv_pool import MHATokenToKVPool  # noqa: E402
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def _batch(seed: int, mode: ForwardMode, page_size: int, dtype: torch.dtype, heads: int,
           kv_heads: int, head_dim: int,
           max_extend: int = 12) -> tuple[dict, MHATokenToKVPool, ReqToTokenPool]:
    """A random batch over a KV pool whose unowned slots hold NaN (an unmasked read of one
    poisons the output): its ForwardBatch and new q/k/v; the prefixes are already cached."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs = rng.randint(1, 3)
    prefix_lens = [rng.choice([0, rng.randint(1, 30)]) for _ in range(bs)]
    if mode.is_decode:
        prefix_lens = [max(p, 1) - 1 for p in prefix_lens]
        extend_lens = [1] * bs
    else:
        extend_lens = [rng.randint(1, max_extend) for _ in range(bs)]
    num_pages = 96
    pool = MHATokenToKVPool(num_pages * page_size, page_size, dtype, kv_heads, head_dim, 1, "cpu")
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer[page_size:] = float("nan")
    req_pool = ReqToTokenPool(6, 96, "cpu")
    pages = list(range(1, num_pages + 1))
    rng.shuffle(pages)
    rows = rng.sample(range(6), bs)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    locs = []
    for row, prefix, extend in zip(rows, prefix_lens, extend_lens, strict=True):
        seq_len = prefix + extend
        own = [pages.pop() for _ in range(-(-seq_len // page_size))]
        slots = torch.tensor([own[p // page_size] * page_size + p % page_size
                              for p in range(seq_len)])
        req_pool.req_to_token[row, :seq_len] = slots
        pool.set_kv_buffer(0, slots[:prefix], rand(prefix, kv_heads, head_dim),
                           rand(prefix, kv_heads, head_dim))
        locs.append(slots[prefix:])
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    n = sum(extend_lens)
    fb = ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens,
                                                                   strict=True)]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens if mode.is_extend else None,
        extend_seq_lens_cpu=extend_lens if mode.is_extend else None,
    )
    qkv = {"q": rand(n, heads * head_dim), "k": rand(n, kv_heads * head_dim),
           "v": rand(n, kv_heads * head_dim)}
    return {"fb": fb, **qkv}, pool, req_pool


def _attend(name: str, batch: dict, pool: MHATokenToKVPool, req_pool: ReqToTokenPool,
            heads: int, kv_heads: int, head_dim: int, kv_splits: int | None = None) -> torch.Tensor:
    backend = create_attention_backend(name, req_pool, pool)
    if kv_splits is not None:
        backend.num_kv_splits = kv_splits
    attn = Attention(heads, head_dim, head_dim**-0.5, kv_heads, 0, backend)
    backend.init_forward_metadata(batch["fb"])
    return attn(batch["q"], batch["k"], batch["v"], batch["fb"])


CASES = [  # (seed, mode, page_size, dtype, heads, kv_heads, head_dim)
    (0, ForwardMode.DECODE, 1, torch.float32, 4, 2, 64),
    (1, ForwardMode.DECODE, 4, torch.float16, 4, 1, 64),
    (2, ForwardMode.DECODE, 16, torch.float32, 2, 2, 128),
    (3, ForwardMode.EXTEND, 1, torch.float32, 4, 2, 64),
    (4, ForwardMode.EXTEND, 4, torch.float16, 4, 1, 64),
    (5, ForwardMode.EXTEND, 8, torch.float32, 2, 1, 128),
    (6, ForwardMode.EXTEND, 2, torch.float16, 2, 2, 80),  # head_dim not a power of two
]


def test_extend_over_several_query_and_key_blocks():
    """New tokens longer than one query block (32 in fp32), after a cached prefix."""
    shape = (2, 1, 64)
    batch, pool, req_pool = _batch(11, ForwardMode.EXTEND, 1, torch.float32, *shape,
                                   max_extend=40)
    assert max(batch["fb"].extend_seq_lens_cpu) > 32
    torch.testing.assert_close(_attend("triton", batch, pool, req_pool, *shape),
                               _attend("torch_native", batch, pool, req_pool, *shape),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("seed", "mode", "page_size", "dtype", "heads", "kv_heads", "head_dim"),
                         CASES)
def test_triton_matches_torch_native(seed, mode, page_size, dtype, heads, kv_heads, head_dim):
    shape = (heads, kv_heads, head_dim)
    batch, pool, req_pool = _batch(seed, mode, page_size, dtype, *shape)
    # The GPU's 8 KV splits once, the interpreter's default (2) otherwise.
    out = _attend("triton", batch, pool, req_pool, *shape, kv_splits=8 if seed == 0 else None)
    layer_k = pool.get_key_buffer(0).clone()
    fb = batch["fb"]
    assert torch.equal(layer_k[fb.out_cache_loc],
                       batch["k"].view(-1, kv_heads, head_dim))  # new K written
    expected = _attend("torch_native", batch, pool, req_pool, *shape)
    assert out.dtype == dtype and out.shape == expected.shape
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


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
