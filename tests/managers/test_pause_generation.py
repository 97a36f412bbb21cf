"""Pause and continue in the scheduler, step by step, on the plain and the overlap schedule.

A paused scheduler runs no step but still handles messages: new requests queue up, aborts take
effect at once, the internal state reports ``paused``. After the continue, greedy outputs equal
those of an uninterrupted run (and transformers'), and every KV slot comes back (the shared leak
check after each test).
"""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    FlushCacheReq,
    GetInternalStateReq,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from tests.checkpoints import VOCAB_SIZE
from tests.managers.conftest import (
    MAX_NEW_TOKENS,
    Result,
    SchedulerDriver,
    assert_matches_reference,
    hf_reference,
    make_prompts,
    new_driver,
)

PROMPTS = make_prompts(VOCAB_SIZE, (7, 19, 33), seed=11)


@pytest.fixture(params=[False, True], ids=["plain", "overlap"])
def overlap(request) -> bool:
    return request.param


@pytest.fixture
def driver(llama_path, overlap) -> SchedulerDriver:
    return new_driver(llama_path, enable_overlap_schedule=overlap)


@pytest.fixture(scope="module")
def refs(llama_path):
    return hf_reference(llama_path, PROMPTS)


def pause(driver: SchedulerDriver, mode: str) -> PauseGenerationReqOutput:
    driver.send(PauseGenerationReqInput(mode=mode))
    reply = driver.replies.pop()
    assert isinstance(reply, PauseGenerationReqOutput)
    return reply


def resume(driver: SchedulerDriver) -> None:
    driver.send(ContinueGenerationReqInput())
    assert isinstance(driver.replies.pop(), ContinueGenerationReqOutput)


def state(driver: SchedulerDriver) -> dict:
    driver.send(GetInternalStateReq())
    return driver.replies.pop().state


def start(driver: SchedulerDriver, steps: int = 4) -> None:
    """Submit the prompts (streamed, so tokens arrive as they come) and run a few steps."""
    for i, ids in enumerate(PROMPTS):
        driver.submit(f"r{i}", ids, stream=True, ignore_eos=True)
    for _ in range(steps):
        assert driver.scheduler.step()


def assert_like_transformers(refs, tokens: dict[str, list[int]]) -> None:
    for i, ref in enumerate(refs):
        assert len(tokens[f"r{i}"]) == MAX_NEW_TOKENS
        assert_matches_reference(Result(tokens=tokens[f"r{i}"]), ref)


def collected(driver: SchedulerDriver, so_far: dict[str, list[int]]) -> dict[str, list[int]]:
    for rid, result in driver.results().items():
        so_far.setdefault(rid, []).extend(result.tokens)
    return so_far


def test_in_place_pause_keeps_kv_runs_nothing_and_resumes_where_it_stopped(driver, refs, overlap):
    start(driver)
    tokens = collected(driver, {})
    sched = driver.scheduler
    assert (sched.overlap is not None) == overlap
    in_flight = (lambda: sched.overlap.in_flight) if overlap else (lambda: None)
    assert (in_flight() is not None) == overlap, "the overlap schedule has a step running"
    pause(driver, "in_place")
    assert in_flight() is None, "the step in flight is processed before the reply"
    tokens = collected(driver, tokens)  # the overlap schedule's last step is in
    running = state(driver)
    assert running["paused"] is True and running["num_running_reqs"] == len(PROMPTS)
    memory = running["memory"]
    assert memory["available_kv_tokens"] + memory["evictable_kv_tokens"] < memory[
        "total_kv_tokens"], "the paused requests hold their KV"
    for _ in range(3):
        assert not sched.step(), "a paused scheduler runs no batch"
    assert driver.results() == {}
    # New requests queue up; the cache cannot be flushed under requests holding KV.
    driver.submit("late", PROMPTS[0], ignore_eos=True)
    assert state(driver)["num_waiting_reqs"] == 1
    driver.send(FlushCacheReq())
    assert not driver.replies.pop().success
    resume(driver)
    assert state(driver)["paused"] is False
    driver.run()
    tokens = collected(driver, tokens)
    assert_like_transformers(refs, tokens)
    assert tokens["late"] == tokens["r0"]


def test_retract_pause_frees_all_kv_and_the_requests_re_prefill_after_continue(driver, refs):
    start(driver)
    before = state(driver)["num_retracted_reqs"]
    reply = pause(driver, "retract")
    assert reply.num_retracted == len(PROMPTS) and reply.num_aborted == 0
    now = state(driver)
    assert now["paused"] is True
    assert now["num_running_reqs"] == 0 and now["num_waiting_reqs"] == len(PROMPTS)
    assert now["num_retracted_reqs"] == before + len(PROMPTS)
    memory = now["memory"]
    # Nothing is locked: the retracted requests' KV is in the cache, evictable.
    assert memory["protected_kv_tokens"] == 0
    assert memory["available_kv_tokens"] + memory["evictable_kv_tokens"] == memory[
        "total_kv_tokens"]
    assert memory["free_req_slots"] == memory["total_req_slots"]
    tokens = collected(driver, {})
    assert not driver.scheduler.step()
    resume(driver)
    driver.run()
    assert_like_transformers(refs, collected(driver, tokens))


def test_abort_pause_ends_every_request_and_later_ones_wait_for_the_continue(llama_path, overlap):
    driver = new_driver(llama_path, max_running_requests=2, enable_overlap_schedule=overlap)
    start(driver, steps=3)  # two run, one waits for a request row
    assert state(driver)["num_waiting_reqs"] == 1
    reply = pause(driver, "abort")
    assert reply.num_aborted == len(PROMPTS)
    results = driver.results()
    assert {rid: r.finished_reason["type"] for rid, r in results.items()} == {
        "r0": "abort", "r1": "abort", "r2": "abort"}
    idle = state(driver)
    assert idle["paused"] and idle["num_running_reqs"] == idle["num_waiting_reqs"] == 0
    assert idle["last_leak_check"]["ok"]
    driver.send(FlushCacheReq())
    assert driver.replies.pop().success, "an aborted, paused scheduler is idle: flush works"
    driver.submit("after", PROMPTS[1], ignore_eos=True)
    assert not driver.scheduler.step() and driver.results() == {}
    resume(driver)
    driver.run()
    assert driver.results()["after"].finished_reason["type"] == "length"


def test_abort_while_paused_in_place_takes_effect_at_once(driver):
    start(driver)
    pause(driver, "in_place")
    driver.results()
    driver.send(AbortReq(rid="r1"))
    aborted = driver.results()["r1"]
    assert aborted.finished_reason == {"type": "abort", "message": "aborted by request"}
    now = state(driver)
    assert now["num_running_reqs"] == len(PROMPTS) - 1
    resume(driver)
    driver.run()
    assert sorted(driver.results()) == ["r0", "r2"]


def test_pause_twice_applies_the_new_mode_and_continue_when_running_is_a_no_op(driver):
    resume(driver)
    start(driver)
    pause(driver, "in_place")
    assert pause(driver, "retract").num_retracted == len(PROMPTS)
    assert pause(driver, "abort").num_aborted == len(PROMPTS)
    resume(driver)
    resume(driver)
    assert state(driver)["paused"] is False
    driver.run()


def test_a_streaming_session_turn_retracted_by_a_pause_keeps_its_slot_and_resumes_it(llama_path):
    driver = new_driver(llama_path, enable_streaming_session=True)
    driver.send(OpenSessionReqInput(capacity_of_str_len=1000, session_id="s", streaming=True))
    assert driver.replies.pop().success

    def turn(rid: str, ids: list[int]) -> None:
        driver.send(TokenizedGenerateReqInput(
            rid=rid, input_ids=ids,
            sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
            session_params=SessionParams(id="s")))

    turn("t1", PROMPTS[0])
    driver.run()
    first = driver.results()["t1"]
    history = PROMPTS[0] + first.tokens + PROMPTS[1]
    turn("t2", PROMPTS[1])
    driver.scheduler.step()  # t2's prefill: its KV joins the slot's, one token sampled
    assert pause(driver, "retract").num_retracted == 1
    paused_state = state(driver)
    memory = paused_state["memory"]
    # The slot keeps the whole conversation's KV: the first prompt (the tree's, locked by the
    # session) and the rest (the slot's own).
    assert memory["protected_kv_tokens"] == len(PROMPTS[0])
    assert memory["session_held_kv_tokens"] == len(history) - len(PROMPTS[0])
    resume(driver)
    driver.scheduler.step()  # the retry matches the slot: only the sampled token's KV is new
    assert state(driver)["num_prefill_tokens"] - paused_state["num_prefill_tokens"] == 1
    driver.run()
    second = driver.results()["t2"]
    plain = driver.generate({"plain": history}, max_new_tokens=8, ignore_eos=True)["plain"]
    assert second.tokens == plain.tokens
