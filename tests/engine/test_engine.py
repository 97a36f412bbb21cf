"""End to end through the real processes: Engine → scheduler → detokenizer → Engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve import Engine
from radixserve.finish_reason import FinishAbort, FinishLength
from tests.engine.conftest import ENGINE_KWARGS, engine_paused, engine_state, wait_idle
from tests.sync import UNTIL_ABORTED, in_background, wait_for

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over the lazy dog"
MEMORY_KEYS = {
    "available_kv_tokens", "evictable_kv_tokens", "protected_kv_tokens",
    "session_held_kv_tokens", "session_offloaded_tokens", "total_kv_tokens", "free_req_slots",
    "total_req_slots",
}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def engine(request, llama_path, strict_env):
    """Every test runs on the plain schedule and on the overlap schedule."""
    with Engine(model_path=str(llama_path), enable_overlap_schedule=request.param,
                **ENGINE_KWARGS) as eng:
        yield eng


@pytest.fixture(autouse=True)
def leak_invariant_holds_after_each_test(engine):
    """Once idle after every test, all KV is free or evictable and every request slot is free."""
    yield
    state = wait_idle(engine)
    m = state["memory"]
    held = (m["available_kv_tokens"] + m["evictable_kv_tokens"] + m["protected_kv_tokens"]
            + m["session_held_kv_tokens"])
    assert held == m["total_kv_tokens"], m
    assert m["protected_kv_tokens"] == 0 and m["free_req_slots"] == m["total_req_slots"], m
    assert state["last_leak_check"]["ok"], state["last_leak_check"]


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path, local_files_only=True)


def long_stream(engine: Engine, rid: str):
    """A stream that runs until the test ends it (see ``tests/sync.py``); call ``next`` on it
    for its first chunk."""
    params = {"temperature": 0.0, "max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}
    return engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=True, rid=rid)


def wait_queued(engine: Engine, n: int = 1) -> dict:
    return wait_for(lambda: engine_state(engine), lambda s: s["num_waiting_reqs"] == n,
                    f"{n} request(s) queued in the paused scheduler")


def test_generate_single_returns_text_ids_and_meta(engine, tokenizer):
    out = engine.generate(PROMPT, GREEDY, rid="single")
    meta = out["meta_info"]
    assert meta["id"] == "single"
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert "output_token_logprobs" not in meta


def test_generate_batch_keeps_input_order(engine):
    prompts = ["alpha beta", "one two three four five", "x"]
    outs = engine.generate(prompts, GREEDY, rid=["b0", "b1", "b2"])
    assert [o["meta_info"]["id"] for o in outs] == ["b0", "b1", "b2"]
    singles = [engine.generate(p, GREEDY) for p in prompts]
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in singles]


def test_a_batch_reaches_the_scheduler_whole_and_is_prefilled_in_one_step(engine):
    """The prompts of one call travel as one message, so the scheduler never starts a prefill
    on the first few while the rest are still on the wire (which single sends allowed). As
    many prompts as the engine's ``max_running_requests``."""
    before = engine_state(engine)["num_prefill_steps"]
    n = ENGINE_KWARGS["max_running_requests"]
    prompts = [[6 + i, 20 + i, 40 + i, 60 + i] for i in range(n)]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1})
    assert [len(o["output_ids"]) for o in outs] == [1] * n
    assert engine_state(engine)["num_prefill_steps"] == before + 1


def test_stream_chunks_are_cumulative_and_end_equal_to_non_stream(engine):
    params = {**GREEDY, "max_new_tokens": 16}
    chunks = list(engine.generate(PROMPT, params, stream=True))
    full = engine.generate(PROMPT, params)
    # How many chunks there are depends on how fast this thread reads (outputs that wait for it
    # are merged into one), so only their order and contents are checked.
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    deltas = "".join(cur["text"][len(prev["text"]):]
                     for prev, cur in zip([{"text": ""}, *chunks], chunks, strict=False))
    assert deltas == chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_batch_stream_chunks_carry_the_prompt_index(engine):
    prompts = ["first prompt", "second, longer prompt here"]
    last: dict[int, dict] = {}
    for chunk in engine.generate(prompts, GREEDY, stream=True):
        last[chunk["index"]] = chunk
    full = engine.generate(prompts, GREEDY)
    assert sorted(last) == [0, 1]
    assert [last[i]["output_ids"] for i in (0, 1)] == [o["output_ids"] for o in full]


def test_logprobs_have_one_entry_per_output_token(engine):
    out = engine.generate(PROMPT, GREEDY, return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    logprobs, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(logprobs) == len(tops) == len(out["output_ids"]) == 8
    assert [tid for _, tid, _ in logprobs] == out["output_ids"]
    for (lp, tid, _), top in zip(logprobs, tops, strict=True):
        assert lp <= 0.0 and len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-4)


def test_same_prompt_twice_hits_the_prefix_cache(engine):
    prompt = "a prompt long enough to be worth caching: " + PROMPT
    first = engine.generate(prompt, GREEDY)
    second = engine.generate(prompt, GREEDY)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["output_ids"] == first["output_ids"]


def test_abort_of_a_running_stream_finishes_it_as_abort(engine):
    stream = long_stream(engine, "to-abort")
    first = next(stream)
    engine.abort("to-abort")
    chunks = [first, *stream]
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < UNTIL_ABORTED
    wait_idle(engine)


def test_aborting_the_rid_of_n_samples_aborts_every_sample(engine):
    """The samples of n > 1 run as rid_0, rid_1: the rid the caller gave reaches them all."""
    params = {"temperature": 0.0, "max_new_tokens": UNTIL_ABORTED, "ignore_eos": True, "n": 2}
    stream = engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=True,
                             rid="family")
    first = next(stream)
    engine.abort("family")
    last = {chunk["index"]: chunk["meta_info"] for chunk in [first, *stream]}
    assert sorted(last) == [0, 1]
    assert [m["finish_reason"]["type"] for m in last.values()] == ["abort", "abort"]
    assert all(m["completion_tokens"] < UNTIL_ABORTED for m in last.values())


def test_closing_a_stream_early_aborts_its_request(engine):
    stream = long_stream(engine, "disconnect")
    next(stream)
    stream.close()  # what a client disconnect does in the HTTP layer
    wait_idle(engine)


def test_flush_cache_refused_while_running_and_accepted_when_idle(engine):
    stream = long_stream(engine, "busy")
    next(stream)
    with engine_paused(engine):  # the request holds its KV until the continue
        assert engine_state(engine)["num_running_reqs"] == 1, "finished before the pause"
        refused = engine.flush_cache()
        assert refused["success"] is False and "1 running" in refused["message"]
    stream.close()
    wait_idle(engine)
    assert engine.flush_cache()["success"] is True
    prompt = "after the flush " + PROMPT
    engine.generate(prompt, GREEDY)
    assert engine.flush_cache()["success"] is True
    assert engine.generate(prompt, GREEDY)["meta_info"]["cached_tokens"] == 0


def test_a_flush_right_after_the_last_output_is_accepted(engine):
    """On the overlap schedule a request's last output goes out while the step launched after
    it still computes; a flush that comes then waits for that step instead of being refused.
    ``slow_down`` holds the scheduler just after the output is sent, so the flush lands in that
    window (it passes either way once the scheduler finishes the step for it)."""
    engine.slow_down(0.5)
    try:
        for _ in range(3):
            engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 3})
            reply = engine.flush_cache()
            assert reply["success"] is True, reply
    finally:
        engine.slow_down(None)


def test_stop_string_is_cut_from_text_and_never_streamed(engine):
    params = {**GREEDY, "max_new_tokens": 24}
    full = engine.generate(PROMPT, params)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    out = engine.generate(PROMPT, {**params, "stop": stop})
    assert out["text"] == expected
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    chunks = list(engine.generate(PROMPT, {**params, "stop": stop}, stream=True))
    assert all(expected.startswith(c["text"]) for c in chunks)
    assert chunks[-1]["text"] == expected
    kept = engine.generate(PROMPT, {**params, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(expected + stop)


def test_open_session_rejects_non_positive_capacity(engine):
    with pytest.raises(ValueError, match="capacity_of_str_len"):
        engine.open_session(0)


def test_async_generate_matches_generate(engine):
    expected = engine.generate(PROMPT, GREEDY)

    async def run():
        single = await engine.async_generate(PROMPT, GREEDY)
        chunks = [c async for c in await engine.async_generate(PROMPT, GREEDY, stream=True)]
        return single, chunks

    single, chunks = asyncio.run(run())
    assert single["output_ids"] == chunks[-1]["output_ids"] == expected["output_ids"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"input_ids": []}, "prompt is empty"),
        ({"input_ids": [1] * 1030}, r"1030 tokens.*1024 tokens"),
        ({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}},
         r"1000 tokens and max_new_tokens is 100.*1024"),
        ({"input_ids": [1, 2, 100000]}, r"outside the vocabulary.*100000"),
        ({"sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"sampling_params": {"top_k": 0}}, "top_k"),
        ({"sampling_params": {"top_k": -2}}, "top_k"),
        ({"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"sampling_params": {"temprature": 0.5}}, "unknown sampling parameter.*temprature"),
        ({"prompt": ["ok", ""]}, "prompt 1: the prompt is empty"),
        ({"prompt": "\ud800"}, r"text: holds a lone UTF-16 surrogate \(\\ud800"),
        ({"sampling_params": {"sampling_seed": 2**64}}, r"sampling_params.sampling_seed: .*64"),
        ({"sampling_params": {"top_k": 2**70}}, r"sampling_params.top_k: .*64 bits"),
        ({"session_params": {"id": "s", "offset": 2**64}}, r"session_params.offset: .*64 bits"),
        ({"prompt": ["ok", "ok"], "sampling_params": [{}, {"stop": ["\udfff"]}]},
         r"prompt 1: sampling_params.stop.0: holds a lone UTF-16 surrogate"),
    ],
)
def test_bad_input_raises_value_error_and_engine_keeps_serving(engine, kwargs, message):
    kwargs = {"prompt": None if "input_ids" in kwargs else "hello", **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    with pytest.raises(ValueError, match=message):
        list(engine.generate(**kwargs, stream=True))
    assert engine.generate("hello", GREEDY)["meta_info"]["completion_tokens"] == 8


def test_a_batch_with_one_unsendable_prompt_sends_none_and_registers_nothing(engine):
    received = engine_state(engine)["num_received_reqs"]
    params = [{"max_new_tokens": 4}, {"max_new_tokens": 4, "sampling_seed": 2**64}]
    for _ in range(3):  # the rids are free again each time: nothing stayed registered
        with pytest.raises(ValueError, match="prompt 1: sampling_params.sampling_seed"):
            engine.generate(["first", "second"], params, rid=["ok-0", "bad-1"])
    assert engine.tokenizer_manager.num_inflight == 0
    assert engine_state(engine)["num_received_reqs"] == received
    assert engine.generate("first", GREEDY, rid="ok-0")["meta_info"]["id"] == "ok-0"


def test_an_unsendable_session_capacity_is_a_value_error(engine):
    with pytest.raises(ValueError, match="capacity_of_str_len: .*64 bits"):
        engine.open_session(2**64)


def test_duplicate_rid_in_flight_is_rejected(engine):
    with engine_paused(engine):
        held = in_background(engine.generate, PROMPT, GREEDY, rid="dup")
        wait_queued(engine)
        with pytest.raises(ValueError, match="already in flight"):
            engine.generate("x", GREEDY, rid="dup")
        assert engine.tokenizer_manager.num_inflight == 1
    assert held.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.tokenizer_manager.num_inflight == 0
    wait_idle(engine)


def test_in_place_pause_holds_requests_and_the_continue_gives_the_uninterrupted_output(engine):
    expected = engine.generate(PROMPT, GREEDY)
    with engine_paused(engine):
        assert engine_state(engine)["paused"] is True
        held = in_background(engine.generate, PROMPT, GREEDY)
        state = wait_queued(engine)
        assert state["num_running_reqs"] == 0 and not held.done()
        assert engine.flush_cache()["success"] is False
    assert engine_state(engine)["paused"] is False
    assert held.result(timeout=120)["output_ids"] == expected["output_ids"]


def test_retract_pause_requeues_a_running_stream_that_then_runs_to_its_end(engine):
    stream = long_stream(engine, "retracted")
    first = next(stream)
    with engine_paused(engine, "retract"):
        state = engine_state(engine)
        assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
        assert state["memory"]["protected_kv_tokens"] == 0
        assert state["memory"]["free_req_slots"] == state["memory"]["total_req_slots"]
    last = [first, *stream][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"][: len(first["output_ids"])] == first["output_ids"]
    assert len(last["output_ids"]) == UNTIL_ABORTED


def test_abort_pause_ends_running_and_waiting_requests(engine):
    stream = long_stream(engine, "ended-by-pause")
    first = next(stream)
    with engine_paused(engine):
        waiting = in_background(engine.generate, PROMPT, GREEDY)
        wait_queued(engine)
        engine.pause_generation("abort")
        assert waiting.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "abort"
        state = engine_state(engine)
        assert state["paused"] and state["num_running_reqs"] == state["num_waiting_reqs"] == 0
        assert engine.flush_cache()["success"] is True
    assert [first, *stream][-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_generation_rejects_an_unknown_mode(engine):
    with pytest.raises(ValueError, match="mode must be one of abort, retract, in_place"):
        engine.pause_generation("later")
    assert engine_state(engine)["paused"] is False


def test_metrics_callback_gets_timings_of_every_request(engine):
    seen = []
    engine.tokenizer_manager.on_request_finished = seen.append
    try:
        list(engine.generate(PROMPT, GREEDY, rid="timed", stream=True))
        stream = long_stream(engine, "timed-closed")
        next(stream)
        stream.close()
    finally:
        engine.tokenizer_manager.on_request_finished = None
    wait_idle(engine)
    assert [m.rid for m in seen] == ["timed", "timed-closed"]
    done, closed = seen
    assert done.arrival_time <= done.first_token_time <= done.finish_time
    assert sum(n for _, n in done.token_times) == done.completion_tokens == 8
    assert done.finish_reason == FinishLength(length=8)
    assert isinstance(closed.finish_reason, FinishAbort)


def test_greedy_matches_transformers_on_mixed_length_batch(engine, llama_path):
    torch.manual_seed(0)
    lengths = [3, 17, 5, 40, 1, 9, 28, 12]
    prompts = [torch.randint(3, 500, (n,)).tolist() for n in lengths]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY["max_new_tokens"]):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out["output_ids"] == ids[len(prompt):]


def test_server_info_reports_memory_and_the_invariant_holds_after_all_tests(engine):
    state = wait_idle(engine)
    info = engine.get_server_info()
    assert info["model_path"] == engine.server_args.model_path
    assert info["context_length"] == 1024
    assert info["max_total_num_tokens"] == state["max_total_num_tokens"] > 0
    memory = state["memory"]
    assert set(memory) == MEMORY_KEYS
    assert (memory["available_kv_tokens"] + memory["evictable_kv_tokens"]
            + memory["protected_kv_tokens"] + memory["session_held_kv_tokens"]
            == memory["total_kv_tokens"])
    assert memory["protected_kv_tokens"] == 0
    assert memory["free_req_slots"] == memory["total_req_slots"]
    overlapped = state["num_overlapped_steps"]
    assert overlapped > 0 if engine.server_args.enable_overlap_schedule else overlapped == 0
