"""Speculative decoding (NGRAM) gives the greedy outputs of plain decoding, token for token.

Each test runs the same requests through a plain and a speculative in-process scheduler and
checks that drafts really were accepted (the decoder's counters), that tokens and finish reasons
agree (and match transformers), and, through the shared leak check, that every KV slot and
request row comes back, also after the KV of rejected drafts was freed mid-page.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from radixserve.managers.io_struct import AbortReq
from radixserve.speculative import NgramProposer, greedy_accept
from tests.checkpoints import VOCAB_SIZE
from tests.managers.conftest import (
    assert_matches_reference,
    hf_reference,
    make_prompts,
    new_driver,
)

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}
MAX_NEW = 40


def repetitive_prompts() -> list[list[int]]:
    """Random prompts, and prompts made of a repeated phrase (drafts from the prompt)."""
    prompts = make_prompts(VOCAB_SIZE, (3, 17, 40, 71), seed=5)
    for n, phrase_len in ((60, 7), (45, 11), (90, 5)):
        phrase = make_prompts(VOCAB_SIZE, (phrase_len,), seed=n)[0]
        prompts.append((phrase * (n // phrase_len + 1))[:n])
    return prompts


def run_both(path, prompts: list[list[int]], per_request: dict[str, dict[str, Any]] | None = None,
             **overrides: Any):
    """Results of the plain and the speculative scheduler, and the speculative decoder."""
    results = []
    for spec in (False, True):
        driver = new_driver(path, **(SPEC if spec else {}), **overrides)
        for i, ids in enumerate(prompts):
            params = {"max_new_tokens": MAX_NEW, **(per_request or {}).get(f"p{i}", {})}
            driver.submit(f"p{i}", ids, **params)
        driver.run()
        results.append(driver.results())
    return results[0], results[1], driver.scheduler.loop.decoder


def assert_same(plain, spec) -> None:
    assert plain.keys() == spec.keys()
    for rid, want in plain.items():
        got = spec[rid]
        assert got.tokens == want.tokens, rid
        assert got.finished_reason == want.finished_reason, rid
        assert got.completion_tokens == len(got.tokens)


CONFIGS = {
    "default": {},
    "page16": {"page_size": 16},
    "page4_no_radix": {"page_size": 4, "disable_radix_cache": True},
    "chunked_prefill": {"chunked_prefill_size": 16},
    # Decode runs out of KV: drafts are dropped, requests retracted, outputs unchanged.
    "retract": {"max_total_tokens": 256, "schedule_conservativeness": 0.01},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_outputs_equal_plain_decoding_and_transformers(llama_path, config):
    prompts = repetitive_prompts()
    plain, spec, decoder = run_both(llama_path, prompts, **CONFIGS[config])
    assert decoder.stats.num_verify_steps > 0
    assert decoder.stats.num_accepted_drafts > 0
    assert_same(plain, spec)
    refs = hf_reference(llama_path, prompts, max_new_tokens=MAX_NEW)
    for i, ref in enumerate(refs):
        result = spec[f"p{i}"]
        assert_matches_reference(result, replace(ref, tokens=ref.tokens[: len(result.tokens)]))


def test_stops_and_length_inside_a_draft_end_the_request_there(llama_path):
    """A stop token, a stop string and ``max_new_tokens`` reached in the middle of a run of
    accepted drafts end the request at that token, as plain decoding does. (On this checkpoint
    the first verify step of prompt 5 keeps 7 tokens, of prompt 6 six per step.)"""
    prompts = repetitive_prompts()
    driver = new_driver(llama_path)
    tokens = driver.generate({"r": prompts[5]}, max_new_tokens=MAX_NEW)["r"].tokens
    tokenizer = driver.scheduler.output_processor.tokenizer
    assert tokens[4] not in tokens[:4]
    stop_text = tokenizer.decode(tokens[3:5])
    assert stop_text not in tokenizer.decode(tokens[:4])
    per_request = {
        "p0": {"stop_token_ids": [tokens[4]]},
        "p1": {"max_new_tokens": 11},
        "p2": {"stop": [stop_text]},
    }
    plain, spec, decoder = run_both(llama_path, [prompts[5], prompts[6], prompts[5]], per_request)
    assert decoder.stats.num_accepted_drafts > 0
    assert_same(plain, spec)
    assert spec["p0"].finished_reason == {"type": "stop", "matched": tokens[4]}
    assert spec["p0"].tokens == tokens[:5]
    assert len(spec["p1"].tokens) == 11
    assert spec["p2"].finished_reason == {"type": "stop", "matched": stop_text}
    assert len(spec["p2"].tokens) <= 5


def test_a_radix_hit_reuses_the_kv_speculation_left(llama_path):
    """A second identical request finds the first one's prompt and output in the radix cache
    (written by verify steps) and generates the same tokens."""
    prompt = repetitive_prompts()[5]
    driver = new_driver(llama_path, **SPEC)
    first = driver.generate({"a": prompt}, max_new_tokens=MAX_NEW)["a"]
    second = driver.generate({"b": prompt + first.tokens[:20]}, max_new_tokens=10)["b"]
    assert second.cached_tokens >= len(prompt)
    assert second.tokens == first.tokens[20:30]


def test_abort_storm_of_speculating_requests_leaks_nothing(llama_path):
    prompts = repetitive_prompts() * 3
    driver = new_driver(llama_path, page_size=4, speculative_max_batch_size=32, **SPEC)
    for i, ids in enumerate(prompts):
        driver.submit(f"r{i}", ids, max_new_tokens=MAX_NEW, ignore_eos=True)
    for step in range(12):
        driver.scheduler.step()
        if step % 3 == 2:
            driver.send(AbortReq(rid=f"r{step}"))
    driver.send(AbortReq(rid="", abort_all=True))
    driver.run()
    results = driver.results()
    assert sum(r.finished_reason["type"] == "abort" for r in results.values()) >= 4
    assert driver.scheduler.loop.decoder.stats.num_accepted_drafts > 0
    # the shared fixture checks the memory invariant (no KV slot or row leaked)


def test_sampled_and_logprob_requests_decode_without_speculation(llama_path):
    """A batch with a sampled request or one asking for logprobs runs plain decode steps."""
    prompts = repetitive_prompts()[4:6]
    driver = new_driver(llama_path, **SPEC)
    driver.submit("s", prompts[0], temperature=0.8, max_new_tokens=8)
    driver.submit("l", prompts[1], return_logprob=True, max_new_tokens=8)
    driver.run()
    results = driver.results()
    assert len(results["s"].tokens) == 8 and len(results["l"].logprobs) == 8
    assert driver.scheduler.loop.decoder.stats.num_verify_steps == 0


def test_ngram_proposer_finds_the_longest_most_recent_match():
    proposer = NgramProposer(min_window=2, max_window=4)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0..2 (then 9, 9); [2, 3] alone at 5..6 is shorter
    assert proposer.propose(tokens, 3) == [9, 9, 2]
    assert proposer.propose([5, 6, 7], 3) == []  # no recurrence
    assert proposer.propose([4, 4], 3) == []  # a match of 1 < min_window
    assert NgramProposer(1, 3).propose([4, 4], 3) == [4]
    assert greedy_accept([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]
    assert greedy_accept([5], [4, 9]) == [4]
    assert greedy_accept([], [3]) == [3]
