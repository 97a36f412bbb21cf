"""STANDALONE speculation (a draft model) gives the greedy outputs of plain decoding, token for
token, and sampled tokens with the target's distribution.

Drafts of four kinds on the tiny llama target: the target itself (every draft kept), its int8
copy (most kept), a noised copy (some kept) and a one-layer model of another seed (almost none
kept). The shared leak check (``conftest.py``) also checks that the draft model's KV pool and
rows are all free once the scheduler is idle.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from radixserve.managers.io_struct import AbortReq
from radixserve.speculative import rejection_accept
from tests.checkpoints import VOCAB_SIZE, build_checkpoint
from tests.layers.helpers import kernels_here
from tests.managers.conftest import make_prompts, new_driver
from tests.managers.speculative_helpers import (
    CHI2_5_DOF_999,
    MAX_NEW,
    assert_same,
    chi_square,
    repetitive_prompts,
    run_both,
    session_turns,
)


@pytest.fixture(scope="module")
def drafts(llama_path, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The draft flags of each kind of draft (module doc)."""
    from transformers import AutoModelForCausalLM

    noised = {}
    for name, scale in (("noisy", 0.5), ("mild", 0.15)):
        out = noised[name] = tmp_path_factory.mktemp(f"draft-{name}")
        for f in llama_path.iterdir():
            if not f.name.endswith(".safetensors") and f.is_file():
                shutil.copy(f, out / f.name)
        model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
        model.save_pretrained(out, safe_serialization=True)
    small = build_checkpoint(tmp_path_factory.mktemp("draft-small"), "llama", seed=7,
                             num_hidden_layers=1)
    return {
        "self": {"speculative_draft_model_path": str(llama_path)},
        "self-int8": {"speculative_draft_model_path": str(llama_path),
                      "speculative_draft_model_quantization": "int8"},
        "noisy": {"speculative_draft_model_path": str(noised["noisy"])},
        "mild": {"speculative_draft_model_path": str(noised["mild"])},
        "small": {"speculative_draft_model_path": str(small)},
    }


def spec_flags(drafts, kind: str, steps: int = 4) -> dict[str, Any]:
    return {"speculative_algorithm": "STANDALONE", "speculative_num_steps": steps,
            "speculative_max_batch_size": 16, **drafts[kind]}


def many_prompts() -> list[list[int]]:
    return repetitive_prompts() + make_prompts(VOCAB_SIZE, (5, 23, 48), seed=9)


CONFIGS = {
    "self-int8": ("self-int8", {}),
    "noisy_page16": ("noisy", {"page_size": 16}),
    "small_no_radix": ("small", {"page_size": 4, "disable_radix_cache": True}),
    "chunked_prefill": ("self-int8", {"chunked_prefill_size": 16}),
    # Decode runs out of KV (both pools have 256 slots): requests are retracted, their draft
    # state freed and prefilled again later; outputs unchanged.
    "retract": ("noisy", {"max_total_tokens": 192, "schedule_conservativeness": 0.01}),
}


@pytest.mark.parametrize("config", [
    pytest.param(c, marks=pytest.mark.slow) if c == "retract" else c for c in CONFIGS
])
def test_greedy_outputs_equal_plain_decoding(llama_path, drafts, config):
    kind, overrides = CONFIGS[config]
    prompts = many_prompts()[:6] if config == "retract" else many_prompts()
    plain, spec, scheduler = run_both(llama_path, spec_flags(drafts, kind), prompts, **overrides)
    stats = scheduler.loop.decoder.stats
    if config == "retract":
        assert scheduler.num_retracted_reqs > 0
    assert stats.num_verify_steps > 0
    if kind == "small":  # a random draft: nearly everything rejected (and freed)
        assert stats.num_accepted_drafts < stats.num_draft_tokens // 4
    elif kind == "noisy":  # some kept, most rejected
        assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens // 2
    else:
        assert stats.num_accepted_drafts > stats.num_draft_tokens // 4
    assert_same(plain, spec)


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_bf16_deterministic_greedy_outputs_equal_plain_decoding(llama_path, drafts, proposer):
    """bf16 with ``enable_deterministic_inference``: a verify step's EXTEND over ``[newest,
    drafts...]`` must give each position the bits a decode step would (batch-invariant
    kernels; requests also finish at other steps, so the batches differ), so greedy outputs
    stay the plain ones, with drafts both kept and rejected."""
    if not kernels_here():
        pytest.skip("deterministic inference needs radixserve's CPU kernels")
    flags = ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6,
              "speculative_max_batch_size": 16}
             if proposer == "ngram" else spec_flags(drafts, "noisy"))
    plain, spec, scheduler = run_both(llama_path, flags, many_prompts(), dtype="bfloat16",
                                      enable_deterministic_inference=True)
    stats = scheduler.loop.decoder.stats
    assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens
    assert_same(plain, spec)


def test_a_radix_hit_is_prefilled_by_the_draft_and_continues_the_same(llama_path, drafts):
    prompt = repetitive_prompts()[5]
    driver = new_driver(llama_path, **spec_flags(drafts, "self-int8"))
    first = driver.generate({"a": prompt}, max_new_tokens=MAX_NEW)["a"]
    second = driver.generate({"b": prompt + first.tokens[:20]}, max_new_tokens=10)["b"]
    assert second.cached_tokens >= len(prompt)
    assert second.tokens == first.tokens[20:30]
    assert driver.scheduler.loop.decoder.stats.num_accepted_drafts > 0


def test_stops_and_length_inside_a_draft_end_the_request_there(llama_path, drafts):
    """The target as its own draft: every draft is kept, 7 tokens per step; a stop token, a
    stop string and max_new_tokens that fall inside a step end the request there."""
    prompt = make_prompts(VOCAB_SIZE, (30,), seed=21)[0]
    flags = spec_flags(drafts, "self", steps=6)
    driver = new_driver(llama_path)
    tokens = driver.generate({"r": prompt}, max_new_tokens=MAX_NEW)["r"].tokens
    tokenizer = driver.scheduler.output_processor.tokenizer
    at = next(i for i in range(3, 12) if tokens[i] not in tokens[:i]
              and tokenizer.decode(tokens[i - 1:i + 1]) not in tokenizer.decode(tokens[:i]))
    stop_text = tokenizer.decode(tokens[at - 1:at + 1])
    per_request = {
        "p0": {"stop_token_ids": [tokens[at]]},
        "p1": {"max_new_tokens": 11},
        "p2": {"stop": [stop_text]},
    }
    plain, spec, scheduler = run_both(llama_path, flags, [prompt] * 3, per_request)
    stats = scheduler.loop.decoder.stats
    assert stats.num_accepted_drafts > stats.num_draft_tokens // 2
    assert_same(plain, spec)
    assert spec["p0"].finished_reason == {"type": "stop", "matched": tokens[at]}
    assert spec["p0"].tokens == tokens[: at + 1]
    assert len(spec["p1"].tokens) == 11
    assert spec["p2"].finished_reason == {"type": "stop", "matched": stop_text}


def test_logprobs_of_kept_tokens_equal_plain_decoding(llama_path, drafts):
    prompts = many_prompts()[3:8]
    plain, spec_results, scheduler = run_both(llama_path, spec_flags(drafts, "self-int8"),
                                              prompts, params={"return_logprob": True})
    assert scheduler.loop.decoder.stats.num_accepted_drafts > 0
    for rid, want in plain.items():
        got = spec_results[rid]
        assert got.tokens == want.tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_abort_storm_of_drafting_requests_leaks_nothing(llama_path, drafts):
    """Aborts between steps (after drafts were proposed and verified), then abort-all: both
    pools come back (the fixture checks the target's and the draft's)."""
    prompts = many_prompts() * 2
    driver = new_driver(llama_path, page_size=4,
                        **{**spec_flags(drafts, "noisy"), "speculative_max_batch_size": 32})
    for i, ids in enumerate(prompts):
        driver.submit(f"r{i}", ids, max_new_tokens=MAX_NEW, ignore_eos=True)
    draft = driver.scheduler.loop.decoder.draft_model
    held = 0
    for step in range(14):
        driver.scheduler.step()
        held = max(held, draft.usage()["spec_draft_used_kv_tokens"])
        if step % 3 == 2:
            driver.send(AbortReq(rid=f"r{step}"))
    driver.send(AbortReq(rid="", abort_all=True))
    driver.run()
    results = driver.results()
    assert sum(r.finished_reason["type"] == "abort" for r in results.values()) >= 4
    assert held > 0 and driver.scheduler.loop.decoder.stats.num_verify_steps > 0
    assert draft.usage() == {"spec_draft_total_kv_tokens": draft.runner.max_total_num_tokens,
                             "spec_draft_used_kv_tokens": 0, "spec_draft_reqs": 0}


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "session"])
def test_session_turns_continue_their_history_as_without_speculation(llama_path, drafts,
                                                                     streaming):
    """Turns of a streaming session (its KV kept in the session's slot, the draft's prefilled
    again for each turn) or of a session (a chain and a fork through the radix cache) beside
    plain requests: the plain loop's tokens, drafts kept inside the turns, a replay of the last
    turn from the cache gives its tokens again, and both pools come back (the fixture)."""
    plain, _ = session_turns(llama_path, {}, streaming=streaming, page_size=4)
    spec, scheduler = session_turns(llama_path, spec_flags(drafts, "noisy"),
                                    streaming=streaming, page_size=4)
    assert spec == plain
    assert spec["replay"] == spec["turn2"]
    stats = scheduler.loop.decoder.stats
    assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens  # some kept, some freed


def test_sampled_requests_share_steps_with_greedy_ones(llama_path, drafts):
    torch.manual_seed(0)
    prompts = many_prompts()
    plain = new_driver(llama_path).generate({"g": prompts[6]}, max_new_tokens=MAX_NEW)["g"]
    driver = new_driver(llama_path, page_size=4, **spec_flags(drafts, "self-int8"))
    driver.submit("g", prompts[6], max_new_tokens=MAX_NEW)
    for i in (2, 4, 8):
        driver.submit(f"t{i}", prompts[i], temperature=0.7, top_p=0.9, min_p=0.05,
                      ignore_eos=True, max_new_tokens=MAX_NEW)
    driver.run()
    results = driver.results()
    assert results["g"].tokens == plain.tokens
    assert all(len(results[f"t{i}"].tokens) == MAX_NEW for i in (2, 4, 8))
    assert driver.scheduler.loop.decoder.stats.num_accepted_drafts > 0


def test_rejection_sampling_with_draft_distributions_emits_the_target_distribution():
    """Drafts drawn from ``q``, kept with ``min(1, p/q)``, the residual ``(p - q)+``: the first
    emitted token follows ``p_0``, the one after a kept first draft ``p_1``; redrawing from
    ``p`` itself after a rejection fails the same test."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.1, 0.4, 0.15, 0.2, 0.1],
                      [0.3, 0.05, 0.05, 0.2, 0.3, 0.1],
                      [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.3, 0.0, 0.2, 0.3, 0.1, 0.1],
                      [0.1, 0.4, 0.1, 0.1, 0.2, 0.1]])
    first, second, wrong = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    for _ in range(20000):
        d = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        out = rejection_accept(d, p, gen, draft_probs=q)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        keep = torch.rand(1, generator=gen).item() * q[0, d[0]] < p[0, d[0]]
        wrong[d[0] if keep else int(torch.multinomial(p[0], 1, generator=gen))] += 1
    assert chi_square(first, p[0]) < CHI2_5_DOF_999
    assert chi_square(second, p[1]) < CHI2_5_DOF_999
    assert chi_square(wrong, p[0]) > 10 * CHI2_5_DOF_999


@pytest.mark.slow
def test_sampled_tokens_through_draft_verify_steps_follow_the_target_distribution(
    llama_path, drafts
):
    """End to end: with ``top_k`` 2 at temperature 2, the mildly noised draft samples ``d`` from its
    own top 2 (not always the target's), the verify step keeps or replaces it; over 800
    requests each request's second token (the first verify step's), per first token, follows
    transformers' distribution (chi-square, 1 degree of freedom, p = 0.001)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    temperature = 2.0
    prompt = make_prompts(VOCAB_SIZE, (12,), seed=31)[0]
    flags = {**spec_flags(drafts, "mild", steps=1), "speculative_max_batch_size": 64}
    driver = new_driver(llama_path, max_running_requests=64, **flags)
    torch.manual_seed(0)
    n = 800
    for i in range(n):
        driver.submit(f"r{i}", prompt, temperature=temperature, top_k=2, max_new_tokens=3,
                      ignore_eos=True)
    driver.run()
    results = driver.results()
    stats = driver.scheduler.loop.decoder.stats
    assert stats.num_verify_reqs >= n // 2
    assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens  # both branches taken
    firsts = {r.tokens[0] for r in results.values()}
    assert len(firsts) == 2
    for first in firsts:
        seconds = [r.tokens[1] for r in results.values() if r.tokens[0] == first]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [first]])).logits[0, -1]
        top2 = logits.topk(2)
        probs = torch.softmax(top2.values / temperature, dim=-1)
        counts = torch.tensor([seconds.count(t) for t in top2.indices.tolist()], dtype=torch.float)
        assert counts.sum() == len(seconds) > 150
        assert chi_square(counts, probs) < 10.83


def test_a_draft_with_another_vocabulary_is_refused_at_start(llama_path, tmp_path):
    other = build_checkpoint(tmp_path / "wide", "llama", seed=2, vocab_size=VOCAB_SIZE + 64)
    with pytest.raises(ValueError, match="vocabulary of .* tokens, the target"):
        new_driver(llama_path, speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=str(other))


@pytest.mark.parametrize("flags, named", [
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
      "speculative_eagle_topk": 2}, "speculative_eagle_topk"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
      "speculative_num_steps": 3, "speculative_num_draft_tokens": 3},
     "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
      "speculative_draft_model_quantization": "fp4"}, "speculative_draft_model_quantization"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}, "speculative_num_steps"),
    ({"speculative_draft_model_quantization": "int8"}, "speculative_draft_model_quantization"),
])
def test_bad_standalone_flags_are_refused_naming_the_flag(flags, named):
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match=named):
        ServerArgs(model_path="m", **flags)


def test_standalone_counts_follow_sglang():
    """``num_draft_tokens`` = ``num_steps`` + 1 with top-k 1, each filled in from the other."""
    from radixserve.server_args import ServerArgs

    base = {"model_path": "m", "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": "/d"}
    args = ServerArgs(**base)
    assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (4, 5)
    args = ServerArgs(**base, speculative_num_draft_tokens=3)
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (2, 1)
    ngram = ServerArgs(model_path="m", speculative_algorithm="NGRAM")
    assert ngram.speculative_num_draft_tokens == 8


def test_target_pool_leaves_room_for_the_draft(llama_path, drafts):
    """Planned from memory (no max_total_tokens; a tiny fraction of it), the target's pool
    shrinks by the draft's share: with the target as its own draft both pools hold about half
    the tokens the target alone gets."""
    memory = {"max_total_tokens": None, "mem_fraction_static": 0.0005}
    alone = new_driver(llama_path, **memory).scheduler.max_total_num_tokens
    driver = new_driver(llama_path, **memory, **spec_flags(drafts, "self"))
    target = driver.scheduler.max_total_num_tokens
    draft = driver.scheduler.loop.decoder.draft_model.runner
    assert draft.max_total_num_tokens == target
    assert 0.4 < target / alone < 0.6, (target, alone)
