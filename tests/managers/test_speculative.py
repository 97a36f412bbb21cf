"""Speculative decoding (NGRAM) gives the greedy outputs of plain decoding, token for token.

Each test runs the same requests through a plain and a speculative in-process scheduler and
checks that drafts really were accepted (the decoder's counters), that tokens and finish reasons
agree (and match transformers), and, through the shared leak check, that every KV slot and
request row comes back, also after the KV of rejected drafts was freed mid-page.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from radixserve.managers.io_struct import AbortReq
from radixserve.speculative import (
    NgramProposer,
    greedy_accept,
    rejection_accept,
    sampling_probs,
)
from tests.checkpoints import VOCAB_SIZE
from tests.managers.conftest import (
    assert_matches_reference,
    hf_reference,
    make_prompts,
    new_driver,
)
from tests.managers.speculative_helpers import (
    CHI2_5_DOF_999,
    MAX_NEW,
    assert_same,
    chi_square,
    repetitive_prompts,
    run_both,
    session_turns,
)

# every batch here speculates (the default switch-off, 2, would leave most of them plain)
SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6,
        "speculative_max_batch_size": 16}


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
    plain, spec, scheduler = run_both(llama_path, SPEC, prompts, **CONFIGS[config])
    decoder = scheduler.loop.decoder
    if config == "retract":
        assert scheduler.num_retracted_reqs > 0
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
    plain, spec, scheduler = run_both(
        llama_path, SPEC, [prompts[5], prompts[6], prompts[5]], per_request
    )
    assert scheduler.loop.decoder.stats.num_accepted_drafts > 0
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
    driver = new_driver(llama_path, page_size=4, **{**SPEC, "speculative_max_batch_size": 32})
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


def test_batches_above_the_max_batch_size_decode_without_speculation(llama_path):
    """The default switch-off (2, measured: benchmarks/RESULTS.md): while three requests run,
    steps are plain decode steps; once the shortest has finished, the two left speculate."""
    prompts = repetitive_prompts()[4:7]
    flags = {key: value for key, value in SPEC.items() if key != "speculative_max_batch_size"}
    per_request = {"p0": {"max_new_tokens": 6}}
    plain, spec, scheduler = run_both(llama_path, flags, prompts, per_request,
                                      params={"max_new_tokens": 24})
    assert scheduler.loop.decoder.max_batch_size == 2
    stats = scheduler.loop.decoder.stats
    assert stats.num_verify_steps > 0 and stats.num_accepted_drafts > 0
    assert stats.num_verify_reqs <= 2 * stats.num_verify_steps
    assert_same(plain, spec)


def test_seeded_and_logprob_requests_decode_without_speculation(llama_path):
    """A batch with a seeded sampled request, or one asking for top logprobs, runs plain decode
    steps."""
    prompts = repetitive_prompts()[4:6]
    for params in ({"temperature": 0.8, "sampling_seed": 3},
                   {"return_logprob": True, "top_logprobs_num": 2}):
        driver = new_driver(llama_path, **SPEC)
        driver.submit("a", prompts[0], max_new_tokens=8, **params)
        driver.submit("b", prompts[1], max_new_tokens=8)
        driver.run()
        results = driver.results()
        assert len(results["a"].tokens) == 8
        assert driver.scheduler.loop.decoder.stats.num_verify_steps == 0


def test_logprobs_of_kept_tokens_equal_plain_decoding_and_transformers(llama_path):
    prompts = repetitive_prompts()[4:7]
    plain, spec_results, scheduler = run_both(llama_path, SPEC, prompts,
                                              params={"return_logprob": True})
    assert scheduler.loop.decoder.stats.num_accepted_drafts > 0
    refs = hf_reference(llama_path, prompts, max_new_tokens=MAX_NEW)
    for i, ref in enumerate(refs):
        got, want = spec_results[f"p{i}"], plain[f"p{i}"]
        assert got.tokens == want.tokens
        assert len(got.logprobs) == len(got.tokens)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert_matches_reference(got, replace(ref, tokens=ref.tokens[: len(got.tokens)]),
                                 check_logprobs=True)


def test_sampled_requests_speculate_by_rejection_sampling(llama_path):
    """Unseeded sampled requests (low temperature: drafts from their repetitive output are
    often kept) share verify steps with a greedy one, whose tokens stay the plain ones.

    Unseeded requests draw from torch's global generator, whose state depends on the tests
    that ran before: it is fixed here, and the sampled requests ignore EOS (one sampled EOS
    in a few seeds, ending a request early)."""
    torch.manual_seed(0)
    prompts = repetitive_prompts()
    plain = new_driver(llama_path).generate({"g": prompts[6]}, max_new_tokens=MAX_NEW)["g"]
    driver = new_driver(llama_path, page_size=4, **SPEC)
    driver.submit("g", prompts[6], max_new_tokens=MAX_NEW)
    for i in (2, 4, 6):
        driver.submit(f"t{i}", prompts[i], temperature=0.3, top_p=0.9, min_p=0.05,
                      ignore_eos=True, max_new_tokens=MAX_NEW)
    driver.run()
    results = driver.results()
    assert results["g"].tokens == plain.tokens
    assert all(len(results[f"t{i}"].tokens) == MAX_NEW for i in (2, 4, 6))
    assert driver.scheduler.loop.decoder.stats.num_accepted_drafts > 0


def test_rejection_sampling_emits_the_target_distribution():
    """Over 20,000 verify steps with fixed drafts, the first emitted token follows ``p_0`` and
    the one after an accepted first draft follows ``p_1``; the plausible wrong rule (draw from
    ``p_j`` itself after a rejection) fails the same test."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.05, 0.1, 0.4, 0.15, 0.2, 0.1],
                          [0.3, 0.05, 0.05, 0.2, 0.3, 0.1],
                          [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])
    drafts = [2, 4]
    first, second = torch.zeros(6), torch.zeros(6)
    wrong_first = torch.zeros(6)
    for _ in range(20000):
        out = rejection_accept(drafts, probs, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
        # the wrong rule: keep the draft with probability p(d), else draw from p again
        keep = torch.rand(1, generator=gen).item() < probs[0, 2].item()
        token = 2 if keep else int(torch.multinomial(probs[0], 1, generator=gen))
        wrong_first[token] += 1
    assert chi_square(first, probs[0]) < CHI2_5_DOF_999
    assert chi_square(second, probs[1]) < CHI2_5_DOF_999
    assert chi_square(wrong_first, probs[0]) > 10 * CHI2_5_DOF_999


def test_sampling_probs_apply_the_samplers_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert sampling_probs(logits, 1.0, -1, 1.0, 0.0)[0].tolist() == pytest.approx(
        [0.5, 0.3, 0.15, 0.05])
    top_k = sampling_probs(logits, 1.0, 2, 1.0, 0.0)[0]
    assert (top_k > 0).tolist() == [True, True, False, False]
    top_p = sampling_probs(logits, 1.0, -1, 0.7, 0.0)[0]
    assert (top_p > 0).tolist() == [True, True, False, False]
    min_p = sampling_probs(logits, 1.0, -1, 1.0, 0.2)[0]
    assert (min_p > 0).tolist() == [True, True, True, False]


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


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "session"])
def test_session_turns_continue_their_history_as_without_speculation(llama_path, streaming):
    """Turns of a session (streaming: their KV stays in the session's slot between turns, with
    the rejected drafts' KV freed; not streaming: a chain and a fork through the radix cache)
    beside plain requests: the same tokens as the plain loop, drafts kept inside the turns, and
    a replay of the last turn from the cache gives its tokens again."""
    plain, _ = session_turns(llama_path, {}, streaming=streaming, page_size=4)
    spec, scheduler = session_turns(llama_path, SPEC, streaming=streaming, page_size=4)
    assert spec == plain
    assert spec["replay"] == spec["turn2"]
    assert scheduler.loop.decoder.stats.num_accepted_drafts > 0


@pytest.mark.parametrize("flags, named", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
    ({"speculative_algorithm": "NGRAM", "enable_overlap_schedule": True},
     "enable_overlap_schedule"),
    ({"speculative_algorithm": "NGRAM", "tp_size": 2}, "tp_size"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0},
     "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 4,
      "speculative_ngram_max_match_window_size": 2}, "speculative_ngram_max_match_window_size"),
    ({"speculative_draft_model_path": "/x"}, "speculative_draft_model_path"),
])
def test_bad_speculative_flags_are_refused_naming_the_flag(flags, named):
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match=named):
        ServerArgs(model_path="m", **flags)


def _top(model, ids: list[int], k: int) -> list[int]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return logits.topk(k).indices.tolist()


def test_sampled_tokens_through_verify_steps_follow_the_target_distribution(llama_path):
    """End to end through the model: with ``top_k`` 2 a request's second token is one of two,
    with probabilities transformers gives. The prompt is built so that after either first token
    NGRAM drafts the likelier second token (kept or rejected by the rule); over 1,500 requests
    the second token's frequencies, per first token, pass a chi-square test (1 degree of
    freedom, p = 0.001)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    temperature = 2.0
    prompt = None
    for seed in range(40):  # a prompt R + [u, s_u, v, s_v] whose own top-2 after it is (u, v)
        base = make_prompts(VOCAB_SIZE, (12,), seed=100 + seed)[0]
        u, v = _top(model, base, 2)
        for _ in range(4):
            cand = base + [u, _top(model, base + [u], 1)[0], v, _top(model, base + [v], 1)[0]]
            if sorted(_top(model, cand, 2)) == sorted([u, v]):
                prompt = cand
                break
            u, v = _top(model, cand, 2)
        if prompt is not None and len({prompt[-4], prompt[-2]}) == 2:
            break
        prompt = None
    assert prompt is not None, "no prompt with stable drafts on this checkpoint"
    driver = new_driver(llama_path, speculative_algorithm="NGRAM",
                        speculative_num_draft_tokens=1, speculative_max_batch_size=64,
                        max_running_requests=64)
    torch.manual_seed(0)
    n = 1500
    for i in range(n):
        driver.submit(f"r{i}", prompt, temperature=temperature, top_k=2, max_new_tokens=3,
                      ignore_eos=True)
    driver.run()
    results = driver.results()
    stats = driver.scheduler.loop.decoder.stats
    assert stats.num_verify_reqs >= n // 2
    assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens  # both branches taken
    for first in (prompt[-4], prompt[-2]):
        seconds = [r.tokens[1] for r in results.values() if r.tokens[0] == first]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [first]])).logits[0, -1]
        top2 = logits.topk(2)
        probs = torch.softmax(top2.values / temperature, dim=-1)
        counts = torch.tensor([seconds.count(t) for t in top2.indices.tolist()], dtype=torch.float)
        assert counts.sum() == len(seconds) > 200
        assert chi_square(counts, probs) < 10.83
