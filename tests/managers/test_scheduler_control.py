"""Scheduler handlers: ordering, abort, flush, internal state, bad input, stop conditions."""

from __future__ import annotations

import pytest

from radixserve.managers.dispatcher import TypeBasedDispatcher
from radixserve.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from tests.managers.conftest import MAX_NEW_TOKENS, make_prompts, new_driver


@pytest.fixture(scope="module")
def driver(llama_path):
    return new_driver(llama_path)


@pytest.fixture(scope="module")
def prompts(driver):
    return make_prompts(driver.scheduler.model_config.vocab_size, (10, 14, 18, 22), seed=3)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_lpm_runs_the_longest_cached_prefix_first(llama_path, policy):
    # One request slot: requests run one after another, in admission order.
    driver = new_driver(llama_path, schedule_policy=policy, max_running_requests=1)
    shared, other = make_prompts(driver.scheduler.model_config.vocab_size, (30, 30), seed=4)
    driver.generate({"warm": shared}, max_new_tokens=1)
    driver.submit("unrelated", other, max_new_tokens=2)
    driver.submit("sharing", shared + [7, 8], max_new_tokens=2)
    driver.run()
    finish_order = [o.rid for batch in driver.outputs[-2:] for o in batch.outputs]
    expected = ["sharing", "unrelated"] if policy == "lpm" else ["unrelated", "sharing"]
    assert finish_order == expected
    assert driver.results()["sharing"].cached_tokens == 30


def test_abort_of_a_waiting_request_finishes_it_at_once(llama_path):
    driver = new_driver(llama_path, max_running_requests=1)
    a, b = make_prompts(driver.scheduler.model_config.vocab_size, (8, 8), seed=5)
    driver.submit("running", a, ignore_eos=True)
    driver.submit("waiting", b)
    assert driver.scheduler.step()  # admits "running" only
    driver.send(AbortReq(rid="waiting"))
    aborted = driver.results()["waiting"]
    assert aborted.finished_reason == {"type": "abort", "message": "aborted by request"}
    assert aborted.tokens == []
    driver.run()
    assert driver.results()["running"].finished_reason["type"] == "length"


def test_abort_of_a_running_request_finishes_it_at_the_next_step(driver, prompts):
    driver.submit("victim", prompts[0], stream=True, ignore_eos=True)
    driver.submit("bystander", prompts[1], ignore_eos=True)
    for _ in range(3):
        assert driver.scheduler.step()
    driver.send(AbortReq(rid="victim"))
    assert driver.scheduler.step()
    victim = driver.results()["victim"]
    assert victim.finished_reason["type"] == "abort"
    assert 0 < len(victim.tokens) < MAX_NEW_TOKENS
    assert len(driver.scheduler.running_batch) == 1
    driver.run()
    assert driver.results()["bystander"].finished_reason["type"] == "length"


def test_abort_all_finishes_waiting_and_running_requests(llama_path):
    driver = new_driver(llama_path, max_running_requests=1)
    for i, ids in enumerate(make_prompts(driver.scheduler.model_config.vocab_size, (6, 7, 8))):
        driver.submit(f"r{i}", ids, ignore_eos=True)
    driver.scheduler.step()
    driver.send(AbortReq(abort_all=True))
    driver.run()
    results = driver.results()
    assert sorted(results) == ["r0", "r1", "r2"]
    assert all(r.finished_reason["type"] == "abort" for r in results.values())


def test_abort_between_prefill_chunks_releases_the_chunked_request(llama_path):
    driver = new_driver(llama_path, chunked_prefill_size=8)
    driver.submit("long", make_prompts(driver.scheduler.model_config.vocab_size, (40,))[0])
    assert driver.scheduler.step()
    assert driver.scheduler.chunked_req is not None
    driver.send(AbortReq(rid="long"))
    driver.run()
    assert driver.results()["long"].finished_reason["type"] == "abort"
    assert driver.scheduler.chunked_req is None


def test_running_requests_keep_decoding_between_prefill_chunks(llama_path):
    driver = new_driver(llama_path, chunked_prefill_size=8)
    short, long = make_prompts(driver.scheduler.model_config.vocab_size, (5, 64), seed=6)
    driver.submit("short", short, stream=True, ignore_eos=True)
    driver.scheduler.step()
    driver.submit("long", long, max_new_tokens=2)
    for _ in range(8):
        driver.scheduler.step()
    assert driver.scheduler.chunked_req is not None, "the long prompt is still being chunked"
    assert len(driver.results()["short"].tokens) >= 4


def test_flush_cache_is_refused_while_running_and_empties_the_cache_when_idle(driver, prompts):
    driver.submit("busy", prompts[2])
    driver.scheduler.step()
    driver.send(FlushCacheReq())
    refused = driver.replies.pop()
    assert isinstance(refused, FlushCacheReqOutput) and not refused.success
    assert "running" in refused.message
    driver.run()
    busy = driver.results()["busy"]
    assert driver.scheduler.tree_cache.evictable_size() > 0
    driver.send(FlushCacheReq())
    assert driver.replies.pop().success
    assert driver.scheduler.tree_cache.evictable_size() == 0
    assert driver.scheduler.allocator.available_size() == driver.scheduler.max_total_num_tokens
    after = driver.generate({"after": prompts[2]})["after"]
    assert after.cached_tokens == 0, "the flushed cache must not be matched"
    assert after.tokens == busy.tokens


def test_internal_state_reports_memory_and_queues(driver):
    driver.send(GetInternalStateReq())
    state = driver.replies.pop().state
    assert set(state["memory"]) == {
        "available_kv_tokens", "evictable_kv_tokens", "protected_kv_tokens",
        "session_held_kv_tokens", "session_offloaded_tokens", "total_kv_tokens", "free_req_slots",
        "total_req_slots",
    }
    mem = state["memory"]
    assert mem["available_kv_tokens"] + mem["evictable_kv_tokens"] == mem["total_kv_tokens"]
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
    assert state["max_total_num_tokens"] == driver.scheduler.max_total_num_tokens
    assert state["last_leak_check"]["ok"]


@pytest.mark.parametrize(
    ("input_ids", "params", "message"),
    [
        ([], {}, "the prompt is empty"),
        ([5, 600, 7], {}, "outside the vocabulary [0, 512): [600]"),
        ([-1, 5], {}, "outside the vocabulary [0, 512): [-1]"),
        ([5] * 1000, {"max_new_tokens": 100}, "exceed the model's context length"),
        ([5, 6], {"stop_token_ids": [10_000]}, "stop_token_ids out of vocabulary range"),
    ],
)
def test_bad_input_finishes_with_abort_and_never_runs(driver, input_ids, params, message):
    params.setdefault("max_new_tokens", 4)
    driver.send(TokenizedGenerateReqInput(
        rid="bad", input_ids=input_ids, sampling_params=SamplingParams(**params)))
    result = driver.results()["bad"]
    assert result.finished_reason["type"] == "abort"
    assert message in result.finished_reason["message"]
    assert result.tokens == []
    assert not driver.scheduler.step(), "a rejected request must not reach the model"


def test_prompt_larger_than_the_kv_pool_is_rejected(llama_path):
    driver = new_driver(llama_path, max_total_tokens=32)
    driver.submit("huge", list(range(6, 46)))
    reason = driver.results()["huge"].finished_reason
    assert reason["type"] == "abort" and "does not fit in the KV cache" in reason["message"]


def test_generation_longer_than_the_pool_aborts_with_a_clear_message(llama_path):
    driver = new_driver(llama_path, max_total_tokens=32)
    driver.submit("grows", list(range(6, 26)), max_new_tokens=40, ignore_eos=True)
    driver.run()
    result = driver.results()["grows"]
    assert result.finished_reason["type"] == "abort"
    assert "out of KV cache memory" in result.finished_reason["message"]
    assert len(result.tokens) > 0


def test_session_requests_on_unknown_or_refused_sessions_are_rejected(driver, prompts):
    driver.send(OpenSessionReqInput(capacity_of_str_len=100, streaming=True))
    reply = driver.replies.pop()
    assert not reply.success and "--enable-streaming-session" in reply.message
    driver.send(TokenizedGenerateReqInput(
        rid="sess", input_ids=prompts[0], sampling_params=SamplingParams(max_new_tokens=2),
        session_params=SessionParams(id="x")))
    reason = driver.results()["sess"].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "'x' does not exist" in reason["message"]


def test_max_new_tokens_zero_runs_only_the_prefill_and_caches_the_prompt(driver, prompts):
    driver.submit("zero", prompts[3], max_new_tokens=0)
    assert driver.run() == 1  # one prefill step, no decode
    result = driver.results()["zero"]
    assert result.finished_reason == {"type": "length", "length": 0} and result.tokens == []
    # SGLang's cache_prefix: the prompt is now in the radix cache for the next request.
    again = driver.generate({"again": prompts[3]}, max_new_tokens=1)["again"]
    assert again.cached_tokens == len(prompts[3]) - 1


def test_stop_token_ids_and_stop_strings_end_generation(driver, prompts):
    free = driver.generate({"free": prompts[3]}, ignore_eos=True)["free"].tokens
    assert len(free) == MAX_NEW_TOKENS
    stop_id = free[5]
    by_id = driver.generate({"id": prompts[3]}, ignore_eos=True, stop_token_ids=[stop_id])["id"]
    assert by_id.finished_reason == {"type": "stop", "matched": stop_id}
    assert by_id.tokens == free[: free.index(stop_id) + 1]

    tokenizer = driver.scheduler.output_processor.tokenizer
    text = tokenizer.decode(free)
    stop = text[len(tokenizer.decode(free[:8])):][:3]
    assert stop.strip(), "the chosen stop string must be visible text"
    by_str = driver.generate({"str": prompts[3]}, ignore_eos=True, stop=[stop])["str"]
    assert by_str.finished_reason == {"type": "stop", "matched": stop}
    assert by_str.tokens == free[: len(by_str.tokens)]
    assert stop in tokenizer.decode(by_str.tokens)
    assert stop not in tokenizer.decode(by_str.tokens[:-1])


def test_min_new_tokens_defers_stop_tokens(driver, prompts):
    free = driver.generate({"free": prompts[3]}, ignore_eos=True)["free"].tokens
    first = free[0]
    result = driver.generate({"m": prompts[3]}, ignore_eos=True, stop_token_ids=[first],
                             min_new_tokens=3)["m"]
    assert len(result.tokens) >= 3


def test_logprobs_come_with_requested_top_logprobs(driver, prompts):
    result = driver.generate({"lp": prompts[1]}, return_logprob=True, top_logprobs_num=3,
                             max_new_tokens=5)["lp"]
    assert len(result.logprobs) == len(result.tokens) == len(result.top_logprobs)
    for token, logprob, top in zip(result.tokens, result.logprobs, result.top_logprobs,
                                   strict=True):
        assert len(top) == 3 and top[0][0] == token  # greedy: the chosen token is the top one
        assert abs(top[0][1] - logprob) < 1e-6


def test_dispatcher_routes_by_exact_type_and_rejects_unknown_types():
    dispatcher = TypeBasedDispatcher([(int, lambda x: x + 1), (str, str.upper)])
    assert dispatcher(1) == 2 and dispatcher("a") == "A"
    with pytest.raises(TypeError, match="no handler for message type bool"):
        dispatcher(True)


def test_stats_lines_as_sglang_logs_them(llama_path, caplog):
    """One "Prefill batch." line per prefill, one "Decode batch." line every 40 decode steps."""
    import logging

    from radixserve.managers.scheduler.scheduler_stats import DECODE_LOG_INTERVAL

    driver = new_driver(llama_path)
    with caplog.at_level(logging.INFO, logger="radixserve.managers.scheduler.scheduler"):
        driver.generate({"a": [7] * 9, "b": [8] * 5},
                        max_new_tokens=DECODE_LOG_INTERVAL + 2, ignore_eos=True)
    lines = [r.getMessage() for r in caplog.records]
    prefills = [m for m in lines if m.startswith("Prefill batch. ")]
    decodes = [m for m in lines if m.startswith("Decode batch. ")]
    assert prefills[0].startswith("Prefill batch. #new-seq: 2, #new-token: 14, #cached-token: 0")
    assert len(decodes) == 1 and "#running-req: 2" in decodes[0]
    assert "gen throughput (token/s): " in decodes[0] and "#queue-req: 0" in decodes[0]
    stats = driver.scheduler.stats.summary()
    assert stats["num_generated_tokens"] == 2 * (DECODE_LOG_INTERVAL + 1)
    assert stats["gen_throughput"] > 0
