"""The overlap schedule (``enable_overlap_schedule``) gives the outputs of the plain schedule.

Each test runs the same requests through a plain and an overlapped in-process scheduler and
checks that steps really were launched ahead (``OverlapSchedule.num_steps``), that greedy tokens,
finish reasons and logprobs agree (and match transformers), and, through the shared leak check,
that every KV slot and request row comes back.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from radixserve.managers.io_struct import (
    AbortReq,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from tests.checkpoints import VOCAB_SIZE
from tests.managers.conftest import (
    assert_matches_reference,
    hf_reference,
    make_prompts,
    new_driver,
)

LENS = (3, 9, 17, 26, 40, 55)
# Finishes spread over the run: every step but the last ends some request while the next step,
# planned before that was known, is already running.
MAX_NEW = (4, 7, 11, 16, 20, 13)

CONFIGS = {
    "default": {},
    "page16": {"page_size": 16},
    "no_radix": {"disable_radix_cache": True},
    # Decode runs out of KV: the overlapped loop must stop planning ahead and retract.
    "retract": {"max_total_tokens": 160, "schedule_conservativeness": 0.01},
}


def run_both(path, prompts: dict[str, list[int]], per_request: dict[str, dict[str, Any]],
             **overrides: Any):
    """Results of the plain and the overlapped scheduler, and the overlapped one itself."""
    results = []
    for overlap in (False, True):
        driver = new_driver(path, enable_overlap_schedule=overlap, **overrides)
        for rid, ids in prompts.items():
            driver.submit(rid, ids, return_logprob=True, **per_request.get(rid, {}))
        driver.run()
        results.append(driver.results())
    return results[0], results[1], driver.scheduler


def assert_same_outputs(plain, overlapped) -> None:
    assert plain.keys() == overlapped.keys()
    for rid, want in plain.items():
        got = overlapped[rid]
        assert got.tokens == want.tokens, rid
        assert got.finished_reason == want.finished_reason, rid
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5), rid
        assert got.completion_tokens == len(got.tokens)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_outputs_equal_the_plain_schedule_and_transformers(llama_path, config):
    prompts = make_prompts(VOCAB_SIZE, LENS, seed=3)
    refs = hf_reference(llama_path, prompts, max_new_tokens=max(MAX_NEW))
    named = {f"p{i}": ids for i, ids in enumerate(prompts)}
    per_request: dict[str, dict[str, Any]] = {
        f"p{i}": {"max_new_tokens": n} for i, n in enumerate(MAX_NEW)
    }
    # One request stops on a token it generates (a stop finish, not a length one), at step 6.
    per_request["p5"]["stop_token_ids"] = [refs[5].tokens[5]]
    plain, overlapped, scheduler = run_both(llama_path, named, per_request, **CONFIGS[config])

    assert scheduler.overlap.num_steps > 0
    if config == "retract":
        assert scheduler.num_retracted_reqs > 0
    assert_same_outputs(plain, overlapped)
    assert overlapped["p5"].finished_reason["type"] == "stop"
    assert len(overlapped["p5"].tokens) <= 6
    for i, ref in enumerate(refs):
        result = overlapped[f"p{i}"]
        assert_matches_reference(result, replace(ref, tokens=ref.tokens[: len(result.tokens)]))


def test_arrivals_aborts_and_output_reading_samplers_wait_for_the_step_in_flight(llama_path):
    """A request arriving mid-decode, an abort of a running request and a penalised request
    (its sampler reads the outputs) each make the overlapped loop process the step in flight
    first; the tokens are still those of the plain schedule."""
    prompts = make_prompts(VOCAB_SIZE, (8, 21, 34, 13), seed=4)
    finals = []
    for overlap in (False, True):
        driver = new_driver(llama_path, enable_overlap_schedule=overlap)
        driver.submit("a", prompts[0], ignore_eos=True)
        driver.submit("b", prompts[1], ignore_eos=True)
        driver.submit("doomed", prompts[2], ignore_eos=True)
        for _ in range(5):
            assert driver.scheduler.step()
        # A strong bias toward two tokens and a frequency penalty make them alternate with
        # others in a pattern set by exact counts: one token missing from the count changes it.
        driver.submit("late", prompts[3], ignore_eos=True, frequency_penalty=2.0,
                      logit_bias={7: 9.0, 8: 9.0})
        for _ in range(3):
            assert driver.scheduler.step()
        driver.send(AbortReq(rid="doomed"))
        driver.run()
        finals.append((driver.results(), driver.scheduler))
    (plain, _), (overlapped, scheduler) = finals
    assert scheduler.overlap.num_steps > 0
    assert overlapped["doomed"].finished_reason["type"] == "abort"
    assert plain["doomed"].finished_reason["type"] == "abort"
    assert plain["late"].tokens.count(7) > 1 and plain["late"].tokens.count(8) > 1
    for rid in ("a", "b", "late"):
        assert overlapped[rid].tokens == plain[rid].tokens, rid
        assert overlapped[rid].finished_reason == plain[rid].finished_reason
        assert len(overlapped[rid].tokens) == 20


def test_streamed_reports_are_those_of_the_plain_schedule(llama_path):
    """Stream reports go out when a step's tokens are processed, one step later than planned;
    their split into first token, every ``stream_interval`` tokens and the end is unchanged."""
    prompt = make_prompts(VOCAB_SIZE, (12,), seed=2)[0]
    reports = []
    for overlap in (False, True):
        driver = new_driver(llama_path, enable_overlap_schedule=overlap, stream_interval=3)
        driver.submit("s", prompt, stream=True, ignore_eos=True, max_new_tokens=10)
        driver.run()
        reports.append([o.new_token_ids for batch in driver.outputs for o in batch.outputs])
    assert reports[1] == reports[0]
    assert [len(r) for r in reports[1]] == [1, 3, 3, 3]


def test_streaming_session_turns_and_plain_requests_share_the_overlapped_loop(llama_path):
    """Turns of streaming sessions (their KV stays in the session's slot) run next to a plain
    request; the overlapped loop waits for each step of a turn, and every turn continues its
    history as in the plain schedule."""
    turns = make_prompts(VOCAB_SIZE, (11, 5, 7), seed=5)
    long_prompt = make_prompts(VOCAB_SIZE, (30,), seed=6)[0]
    runs = []
    for overlap in (False, True):
        driver = new_driver(llama_path, enable_overlap_schedule=overlap,
                            enable_streaming_session=True)
        driver.send(OpenSessionReqInput(capacity_of_str_len=1000, session_id="chat",
                                        streaming=True))
        tokens = {}
        for i, ids in enumerate(turns):
            driver.submit(f"plain{i}", long_prompt, ignore_eos=True, max_new_tokens=12)
            driver.send(TokenizedGenerateReqInput(
                rid=f"turn{i}", input_ids=ids,
                sampling_params=SamplingParams(temperature=0.0, max_new_tokens=6,
                                               ignore_eos=True),
                session_params=SessionParams(id="chat"),
            ))
            driver.run()
            tokens.update({rid: r.tokens for rid, r in driver.results().items()})
        runs.append((tokens, driver.scheduler))
    (plain, _), (overlapped, scheduler) = runs
    assert scheduler.overlap.num_steps > 0
    assert overlapped == plain
    assert all(len(overlapped[f"turn{i}"]) == 6 for i in range(3))


def test_seeded_sampling_is_reproduced_exactly(llama_path):
    """A seeded sampler's stream is indexed by the number of tokens generated so far, which a
    step planned ahead does not know yet: such batches wait for the step in flight, and the
    samples equal the plain schedule's."""
    prompts = make_prompts(VOCAB_SIZE, (6, 19, 31), seed=7)
    runs = []
    for overlap in (False, True):
        driver = new_driver(llama_path, enable_overlap_schedule=overlap)
        for i, ids in enumerate(prompts):
            driver.submit(f"s{i}", ids, temperature=1.0, top_p=0.9, sampling_seed=100 + i,
                          ignore_eos=True, max_new_tokens=12)
        driver.submit("greedy", prompts[0], ignore_eos=True, max_new_tokens=30)
        driver.run()
        runs.append(({rid: r.tokens for rid, r in driver.results().items()}, driver.scheduler))
    (plain, _), (overlapped, scheduler) = runs
    assert overlapped == plain
    # Once the seeded requests are done, the greedy one decodes ahead.
    assert scheduler.overlap.num_steps > 0


def test_requests_waiting_for_a_row_let_the_running_batch_decode_ahead(llama_path):
    """With every request row taken, the waiting requests can only start after a finish, so
    the running batch keeps decoding ahead; each waiting request starts one step after the
    finish that frees its row, and every output equals the plain schedule's."""
    prompts = make_prompts(VOCAB_SIZE, (7, 15, 23, 31, 12), seed=8)
    runs = []
    for overlap in (False, True):
        driver = new_driver(llama_path, enable_overlap_schedule=overlap, max_running_requests=2)
        for i, ids in enumerate(prompts):
            driver.submit(f"q{i}", ids, ignore_eos=True, max_new_tokens=6 + 3 * i)
        steps = driver.run()
        runs.append(({rid: r.tokens for rid, r in driver.results().items()}, driver.scheduler,
                     steps))
    (plain, _, plain_steps), (overlapped, scheduler, _) = runs
    assert overlapped == plain
    # Only the prefills and the steps right after a finish frees a row wait.
    assert scheduler.overlap.num_steps >= plain_steps * 3 // 4


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_gives_the_plain_schedules_outputs(llama_path, seed):
    """Random arrivals (greedy, penalised, seeded, stop tokens), aborts and memory settings:
    every request ends as in the plain schedule. An aborted request may be cut at another
    step, so its tokens only need to agree as far as both runs got."""
    rng = random.Random(seed)
    config = rng.choice([{}, {"page_size": 4}, {"max_total_tokens": 256,
                                                "schedule_conservativeness": 0.05},
                         {"max_running_requests": 3}, {"chunked_prefill_size": 16}])
    events: list[tuple[int, str, dict[str, Any]]] = []  # (step, rid, request or {} = abort)
    for i in range(10):
        params: dict[str, Any] = {"max_new_tokens": rng.randint(1, 24), "ignore_eos": True}
        kind = rng.choice(["greedy", "greedy", "penalty", "seed", "stop"])
        if kind == "penalty":
            params["repetition_penalty"] = 1.3
        elif kind == "seed":
            params.update(temperature=0.8, sampling_seed=rng.randint(0, 99))
        elif kind == "stop":
            params["stop_token_ids"] = [rng.randrange(6, VOCAB_SIZE)]
        ids = [rng.randrange(6, VOCAB_SIZE) for _ in range(rng.randint(2, 60))]
        events.append((rng.randint(0, 30), f"r{i}", {"ids": ids, **params}))
    aborted = {f"r{i}" for i in rng.sample(range(10), 3)}
    events += [(rng.randint(0, 40), rid, {}) for rid in sorted(aborted)]
    events.sort(key=lambda e: e[0])

    runs = []
    for overlap in (False, True):
        driver = new_driver(llama_path, enable_overlap_schedule=overlap, **config)
        step = 0
        for at, rid, request in events:
            while step < at and driver.scheduler.step():
                step += 1
            if request:
                params = dict(request)
                driver.submit(rid, params.pop("ids"), **params)
            else:
                driver.send(AbortReq(rid=rid))
        driver.run()
        runs.append(driver.results())
    plain, overlapped = runs
    assert driver.scheduler.overlap.num_steps > 0
    assert plain.keys() == overlapped.keys()
    for rid, want in plain.items():
        got = overlapped[rid]
        if rid in aborted:
            n = min(len(got.tokens), len(want.tokens))
            assert got.tokens[:n] == want.tokens[:n], rid
        else:
            assert got.tokens == want.tokens, rid
            assert got.finished_reason == want.finished_reason, rid
