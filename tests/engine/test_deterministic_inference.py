"""``enable_deterministic_inference``: in bf16, a request's greedy tokens do not depend on the
requests beside it, on the prefill chunk size or on the radix cache, and its seeded samples do
not depend on the batch. Real Engines (scheduler and detokenizer processes), 64 prompts of 70 to
300 tokens on a random-weight model, whose nearly flat bf16 logits flip on any rounding
difference."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from radixserve import Engine
from radixserve.layers import packed_weight
from tests.engine.conftest import ENGINE_KWARGS
from tests.layers.helpers import kernels_here
from tests.model_executor.harness import make_runner

NUM_PROMPTS, NEW_TOKENS = 64, 12
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
KWARGS = {**ENGINE_KWARGS, "dtype": "bfloat16", "enable_deterministic_inference": True,
          "max_total_tokens": 1 << 15, "max_running_requests": NUM_PROMPTS}

pytestmark = pytest.mark.skipif(not kernels_here(), reason="needs radixserve's CPU kernels")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(7, 500) for _ in range(rng.randint(70, 300))]
            for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def engine(llama_path, strict_env) -> Iterator[Engine]:
    with Engine(model_path=llama_path, **KWARGS) as e:
        yield e


def tokens(outs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def concurrent(engine, prompts) -> list[list[int]]:
    """All 64 prompts in one call (prefilled and decoded together), from an empty cache."""
    engine.flush_cache()
    return tokens(engine.generate(input_ids=prompts, sampling_params=GREEDY))


def test_one_at_a_time_equals_64_concurrent(engine, prompts, concurrent):
    engine.flush_cache()
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert alone == concurrent


def test_chunked_prefill_of_64_equals_one_chunk(llama_path, prompts, concurrent, strict_env):
    with Engine(model_path=llama_path, chunked_prefill_size=64, **KWARGS) as chunked:
        assert tokens(chunked.generate(input_ids=prompts, sampling_params=GREEDY)) == concurrent


def test_a_radix_hit_equals_a_cold_prefill(engine, prompts, concurrent):
    engine.flush_cache()
    # the first half of every prompt cached by another request, then the whole prompt
    engine.generate(input_ids=[p[: len(p) // 2] for p in prompts], sampling_params=GREEDY)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens"] >= len(p) // 2
               for o, p in zip(outs, prompts, strict=True))
    assert tokens(outs) == concurrent


def test_a_radix_hit_on_generated_tokens_equals_a_cold_prefill(engine, prompts):
    """A next turn whose cached prefix holds the last turn's generated tokens (their K/V
    written by decode steps) gives the bits of a cold prefill of the same text."""
    picks = prompts[:16]
    engine.flush_cache()
    first = tokens(engine.generate(input_ids=picks, sampling_params=GREEDY))
    follow = [p + o for p, o in zip(picks, first, strict=True)]
    hit = engine.generate(input_ids=follow, sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens"] >= len(p) + NEW_TOKENS - 1
               for o, p in zip(hit, picks, strict=True))
    engine.flush_cache()
    assert tokens(hit) == tokens(engine.generate(input_ids=follow, sampling_params=GREEDY))


def test_seeded_sampling_is_the_same_in_any_batch(engine, prompts):
    def seeded(i: int) -> dict[str, Any]:
        return {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1000 + i,
                "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

    picks = list(range(0, NUM_PROMPTS, 4))
    engine.flush_cache()
    alone = [engine.generate(input_ids=prompts[i], sampling_params=seeded(i))["output_ids"]
             for i in picks]
    # the same requests inside a batch of greedy ones, in another order
    batch = list(range(NUM_PROMPTS))[::-1]
    params = [seeded(i) if i in picks else GREEDY for i in batch]
    outs = engine.generate(input_ids=[prompts[i] for i in batch], sampling_params=params)
    by_prompt = {i: o["output_ids"] for i, o in zip(batch, outs, strict=True)}
    assert [by_prompt[i] for i in picks] == alone


def test_deterministic_inference_refuses_kernels_that_are_not_batch_invariant(
    llama_path, monkeypatch
):
    with pytest.raises(ValueError, match="needs the cpu attention backend"):
        make_runner(llama_path, dtype="bfloat16", attention_backend="torch_native",
                    enable_deterministic_inference=True)
    # no memory for the kernels' weight copies: the layers would fall back to torch's GEMMs
    monkeypatch.setattr(packed_weight, "PACKED_COPY_MAX_RAM_FRACTION", 0.0)
    with pytest.raises(ValueError, match="no batch-invariant kernel for model.layers.0"):
        make_runner(llama_path, dtype="bfloat16", enable_deterministic_inference=True)
