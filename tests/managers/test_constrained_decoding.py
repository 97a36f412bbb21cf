"""Grammar-constrained decoding in a real in-process scheduler on the tiny test checkpoint.

A random-weight model says nothing sensible, so whatever it produces under a grammar is a strong
test: every output must still parse and validate. Constrained and unconstrained requests share
batches; the grammar must hold through chunked prefill, the radix cache, retraction, sessions
and the overlap schedule.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
from transformers import AutoTokenizer

from radixserve.managers.io_struct import (
    AbortReq,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from tests.constrained.schemas import (
    EBNF,
    EBNF_LANGUAGE,
    MAX_TOKENS,
    REGEXES,
    WHITESPACE_CNT,
    assert_valid,
    random_schemas,
)
from tests.managers.conftest import (
    assert_matches_reference,
    hf_reference,
    make_prompts,
    new_driver,
)

CONSTRAINED = {"constrained_json_max_whitespace_cnt": WHITESPACE_CNT}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# Long outputs (ten strings of 6-8 characters), for memory pressure.
LONG_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "minLength": 6, "maxLength": 8},
    "minItems": 10,
    "maxItems": 10,
}


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(512, (5, 12, 30, 47), seed=7)


def text_of(tokenizer, result) -> str:
    return tokenizer.decode(result.tokens, skip_special_tokens=True)


def assert_stopped_by_grammar(result) -> None:
    assert result.finished_reason == {"type": "stop", "matched": 1}, result.finished_reason


def test_random_schemas_greedy_and_sampled_all_validate_beside_unconstrained(
    llama_path, tokenizer, prompts
):
    driver = new_driver(llama_path, max_total_tokens=32768, **CONSTRAINED)
    schemas = random_schemas(100)
    for i, schema in enumerate(schemas):
        spec = json.dumps(schema)
        prompt = prompts[i % len(prompts)]
        driver.submit(f"greedy{i}", prompt, json_schema=spec, max_new_tokens=MAX_TOKENS)
        driver.submit(f"sampled{i}", prompt, json_schema=spec, max_new_tokens=MAX_TOKENS,
                      temperature=1.0, sampling_seed=i)
    free = {f"free{i}": p for i, p in enumerate(prompts)}
    for rid, ids in free.items():
        driver.submit(rid, ids)
    driver.run()
    results = driver.results()
    for i, schema in enumerate(schemas):
        for mode in ("greedy", "sampled"):
            result = results[f"{mode}{i}"]
            assert_stopped_by_grammar(result)
            assert_valid(text_of(tokenizer, result), schema)
    # Masks of the constrained rows leave the unconstrained rows of the batch alone.
    for (rid, _), ref in zip(free.items(), hf_reference(llama_path, prompts), strict=True):
        assert_matches_reference(results[rid], ref)
    # Greedy and sampled requests of one schema shared one compilation.
    assert len(driver.scheduler.grammars) == len({json.dumps(s) for s in schemas})


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_match_fully(llama_path, tokenizer, prompts, regex):
    driver = new_driver(llama_path)
    for i, prompt in enumerate(prompts):
        driver.submit(f"g{i}", prompt, regex=regex, max_new_tokens=64)
        driver.submit(f"s{i}", prompt, regex=regex, max_new_tokens=64, temperature=1.0,
                      sampling_seed=i)
    driver.run()
    for result in driver.results().values():
        assert_stopped_by_grammar(result)
        assert re.fullmatch(regex, text_of(tokenizer, result)), text_of(tokenizer, result)


def test_ebnf_outputs_are_in_the_grammars_language(llama_path, tokenizer, prompts):
    driver = new_driver(llama_path)
    for i, prompt in enumerate(prompts):
        driver.submit(f"s{i}", prompt, ebnf=EBNF, max_new_tokens=32, temperature=1.0,
                      sampling_seed=i)
    driver.run()
    for result in driver.results().values():
        assert_stopped_by_grammar(result)
        assert EBNF_LANGUAGE.fullmatch(text_of(tokenizer, result))


def test_length_limit_cuts_json_midway_and_says_length(llama_path, tokenizer, prompts):
    driver = new_driver(llama_path, **CONSTRAINED)
    result = driver.generate({"cut": prompts[0]}, json_schema=json.dumps(SCHEMA),
                             max_new_tokens=4)["cut"]
    assert result.finished_reason == {"type": "length", "length": 4}
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(tokenizer, result))


@pytest.mark.parametrize(
    ("field", "spec", "message"),
    [
        ("json_schema", '{"type": "objec"}', 'invalid json_schema: Unsupported type "objec"'),
        ("json_schema", '{"type": "array", "uniqueItems": true}', "'uniqueItems'"),
        ("regex", "[0-9", "invalid regex: Regex parsing error"),
        ("ebnf", "root ::= nothing", 'Rule "nothing" is not defined'),
    ],
)
def test_invalid_grammar_fails_with_400_before_anything_is_scheduled(llama_path, prompts, field,
                                                                     spec, message):
    driver = new_driver(llama_path)
    driver.submit("bad", prompts[1], **{field: spec})
    driver.run()
    # It never ran: a prefill would have left its prompt in the radix cache.
    memory = driver.scheduler.handle_get_internal_state(None).state["memory"]
    assert memory["evictable_kv_tokens"] == 0
    reason = driver.results()["bad"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert message in reason["message"]
    # The scheduler keeps serving.
    assert driver.generate({"next": prompts[1]}, max_new_tokens=3)["next"].completion_tokens == 3


def test_a_grammar_step_over_the_budget_ends_its_request_alone(llama_path, prompts,
                                                                monkeypatch):
    """With a budget of 0 s every grammar step is over it (the guard against matchers whose cost
    grows with the output, constrained/limits.py): the constrained request ends with a 400
    after its first token, its unconstrained neighbour runs to its end, and nothing leaks."""
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_STEP_BUDGET", "0")
    driver = new_driver(llama_path)
    driver.submit("slow", prompts[0], regex="[a-z]{1,40}", max_new_tokens=16)
    driver.submit("free", prompts[1], max_new_tokens=16, ignore_eos=True)
    driver.run()
    results = driver.results()
    reason = results["slow"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "RADIXSERVE_GRAMMAR_STEP_BUDGET" in reason["message"]
    assert results["slow"].completion_tokens == 1
    assert results["free"].completion_tokens == 16
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_STEP_BUDGET", "0.5")  # the default: it completes
    ok = new_driver(llama_path).generate({"ok": prompts[0]}, regex="[a-z]{1,40}",
                                         max_new_tokens=16)["ok"]
    assert ok.finished_reason["type"] in ("stop", "length"), ok.finished_reason


def test_retraction_under_kv_pressure_keeps_every_output_valid(llama_path, tokenizer, prompts):
    driver = new_driver(llama_path, max_total_tokens=192, schedule_conservativeness=0.01,
                        **CONSTRAINED)
    for i in range(6):
        driver.submit(f"r{i}", prompts[i % 2], json_schema=json.dumps(LONG_SCHEMA),
                      max_new_tokens=MAX_TOKENS, temperature=1.0, sampling_seed=i)
    driver.run()
    assert driver.scheduler.num_retracted_reqs > 0
    for result in driver.results().values():
        assert_stopped_by_grammar(result)
        assert len(assert_valid(text_of(tokenizer, result), LONG_SCHEMA)) == 10


@pytest.mark.parametrize(
    "overrides",
    [{"chunked_prefill_size": 8}, {"enable_overlap_schedule": True}, {"page_size": 16}],
    ids=["chunked", "overlap", "page16"],
)
def test_constrained_outputs_do_not_depend_on_batching_or_schedule(llama_path, prompts,
                                                                   overrides):
    def run(**extra):
        driver = new_driver(llama_path, **CONSTRAINED, **extra)
        for i, prompt in enumerate(prompts):
            driver.submit(f"j{i}", prompt, json_schema=json.dumps(SCHEMA), max_new_tokens=200)
            driver.submit(f"f{i}", prompt)
        driver.run()
        return {rid: r.tokens for rid, r in driver.results().items()}

    assert run(**overrides) == run()


def test_radix_cache_hit_gives_the_same_constrained_output(llama_path, prompts):
    driver = new_driver(llama_path, **CONSTRAINED)
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 200}
    first = driver.generate({"a": prompts[3]}, **params)["a"]
    second = driver.generate({"b": prompts[3]}, **params)["b"]
    assert second.cached_tokens > 0 and second.tokens == first.tokens
    state = driver.scheduler.handle_get_internal_state(None).state
    assert state["num_cached_grammars"] == 1 and driver.scheduler.grammars.hits == 1


def test_grammar_wins_over_bias_penalties_min_tokens_and_ignore_eos(llama_path, tokenizer,
                                                                    prompts):
    brace = tokenizer.convert_tokens_to_ids("}")
    driver = new_driver(llama_path, **CONSTRAINED)
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": MAX_TOKENS}
    driver.submit("bias", prompts[0], logit_bias={brace: 100.0}, **params)
    driver.submit("penalties", prompts[0], repetition_penalty=1.8, frequency_penalty=1.5,
                  presence_penalty=1.0, temperature=0.8, sampling_seed=3, **params)
    driver.submit("min_tokens", prompts[0], min_new_tokens=MAX_TOKENS - 1, **params)
    driver.submit("ignore_eos", prompts[0], ignore_eos=True, **params)
    driver.run()
    for result in driver.results().values():
        assert_stopped_by_grammar(result)
        assert_valid(text_of(tokenizer, result), SCHEMA)


def test_session_turns_are_constrained_per_turn(llama_path, tokenizer, prompts):
    driver = new_driver(llama_path, enable_streaming_session=True, **CONSTRAINED)
    for streaming in (False, True):
        driver.send(OpenSessionReqInput(capacity_of_str_len=4096, session_id=f"s{streaming}",
                                        streaming=streaming))
        assert driver.replies.pop().success
        parent = None
        for turn in range(3):
            rid = f"s{streaming}-t{turn}"
            driver.send(TokenizedGenerateReqInput(
                rid=rid, input_ids=prompts[turn],
                sampling_params=SamplingParams(json_schema=json.dumps(SCHEMA), temperature=0.0,
                                               max_new_tokens=200),
                session_params=SessionParams(id=f"s{streaming}", rid=None if streaming else parent),
            ))
            driver.run()
            result = driver.results()[rid]
            assert_stopped_by_grammar(result)
            assert_valid(text_of(tokenizer, result), SCHEMA)
            if turn:
                assert result.cached_tokens > 0  # the earlier turns' KV was reused
            parent = rid


def test_a_grammar_not_compiled_in_time_ends_its_request_and_others_go_on(llama_path, prompts,
                                                                          monkeypatch):
    """The compile thread is held busy (as by a grammar that takes minutes); with a timeout of
    0 s the request waiting behind it ends with a 400 at the next step, the unconstrained one
    runs, and nothing leaks. SGLang's SGLANG_GRAMMAR_TIMEOUT, as RADIXSERVE_GRAMMAR_TIMEOUT."""
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_TIMEOUT", "0")
    driver = new_driver(llama_path)
    release = threading.Event()
    driver.scheduler.grammars._executor.submit(release.wait)  # the one compile thread
    try:
        driver.submit("late", prompts[0], regex="[a-z]{1,8}", max_new_tokens=8)
        driver.submit("free", prompts[1], max_new_tokens=8, ignore_eos=True)
        driver.run()
    finally:
        release.set()
    results = driver.results()
    reason = results["late"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "did not compile within 0 s" in reason["message"]
    assert results["late"].completion_tokens == 0 and results["free"].completion_tokens == 8
    assert driver.scheduler.handle_get_internal_state(None).state["num_grammar_queue_reqs"] == 0


def test_abort_while_the_grammar_compiles_finishes_the_request(llama_path, prompts):
    driver = new_driver(llama_path)
    driver.submit("waiting", prompts[2], json_schema=json.dumps(LONG_SCHEMA))
    state = driver.scheduler.handle_get_internal_state(None).state
    assert state["num_grammar_queue_reqs"] == 1 and state["num_waiting_reqs"] == 1
    driver.send(AbortReq(rid="waiting"))
    driver.run()
    assert driver.results()["waiting"].finished_reason["type"] == "abort"
    assert driver.scheduler.handle_get_internal_state(None).state["num_grammar_queue_reqs"] == 0
