"""Sessions in a real in-process scheduler (tiny model, real pools), step by step.

What the HTTP tests cannot pin down from outside: the order in which a turn and the abort of
the turn before it are judged, what a replaced running request had generated, the slot a
retracted turn leaves behind, and the memory invariant checked after every step
(``RADIXSERVE_STRICT_MEM_CHECK=busy``, on for every test here). Every turn is compared with a
plain request on the ids its session assembled.
"""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.managers.io_struct import (
    AbortReq,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.mem_cache.session_aware_cache import SessionNode
from radixserve.sampling.sampling_params import SamplingParams
from tests.checkpoints import VOCAB_SIZE
from tests.managers.conftest import SchedulerDriver, make_prompts


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_TEST_STRICT", "1")
    monkeypatch.setenv("RADIXSERVE_STRICT_MEM_CHECK", "busy")


def turn_msg(request_id: str, ids: list[int], session: str, max_new_tokens: int = 6,
             **params: Any) -> TokenizedGenerateReqInput:
    """A request of ``session``; keywords are its session params (``rid`` names the parent)."""
    return TokenizedGenerateReqInput(
        rid=request_id, input_ids=ids,
        sampling_params=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                       ignore_eos=True),
        session_params=SessionParams(id=session, **params),
    )


def open_session(driver: SchedulerDriver, session: str, streaming: bool = True) -> None:
    driver.send(OpenSessionReqInput(capacity_of_str_len=10_000, session_id=session,
                                    streaming=streaming))
    assert driver.replies.pop().success


def plain_tokens(driver: SchedulerDriver, ids: list[int], max_new_tokens: int) -> list[int]:
    rid = f"ref-{len(driver.outputs)}"
    driver.submit(rid, ids, ignore_eos=True, max_new_tokens=max_new_tokens)
    driver.run()
    return driver.results()[rid].tokens


def assert_idle_and_accounted(driver: SchedulerDriver) -> None:
    driver.run()
    driver.scheduler.self_check_during_idle()
    assert driver.scheduler.last_leak_check["ok"], driver.scheduler.last_leak_check


def test_a_turn_right_behind_the_abort_of_its_session_turn_is_judged_after_it(llama_path):
    """A client that goes away and sends its next turn at once: both messages reach the
    scheduler in one batch, the abort first. The turn waits for the abort to take effect and
    continues the rolled-back history."""
    driver = SchedulerDriver(llama_path, enable_streaming_session=True)
    first, gone, nxt = make_prompts(VOCAB_SIZE, (9, 5, 4), seed=11)
    open_session(driver, "s")
    driver.send(turn_msg("t1", first, "s"))
    driver.run()
    history = first + driver.results()["t1"].tokens
    driver.send(turn_msg("t2", gone, "s", max_new_tokens=200))
    for _ in range(3):
        driver.scheduler.step()
    driver.scheduler.process_input_requests([AbortReq(rid="t2"), turn_msg("t3", nxt, "s")])
    driver.run()
    results = driver.results()
    assert results["t2"].finished_reason["type"] == "abort"
    t3 = results["t3"]
    assert t3.finished_reason["type"] == "length", t3.finished_reason
    assert t3.prompt_tokens == len(history) + len(nxt)
    assert t3.tokens == plain_tokens(driver, history + nxt, 6)
    assert_idle_and_accounted(driver)


def test_a_second_turn_while_one_runs_is_still_refused(llama_path):
    driver = SchedulerDriver(llama_path, enable_streaming_session=True)
    first, second = make_prompts(VOCAB_SIZE, (9, 5), seed=12)
    open_session(driver, "s")
    driver.send(turn_msg("t1", first, "s", max_new_tokens=30))
    driver.scheduler.step()
    driver.send(turn_msg("t2", second, "s"))
    driver.run()
    results = driver.results()
    assert results["t2"].finished_reason["status_code"] == 400
    assert "in flight" in results["t2"].finished_reason["message"]
    assert results["t1"].finished_reason["type"] == "length"


def test_replace_naming_a_running_request_aborts_it_and_branches_from_what_it_generated(
    llama_path,
):
    driver = SchedulerDriver(llama_path)
    root, new = make_prompts(VOCAB_SIZE, (10, 4), seed=13)
    open_session(driver, "tree", streaming=False)
    driver.send(turn_msg("root", root, "tree", max_new_tokens=200))
    for _ in range(6):
        driver.scheduler.step()
    driver.send(turn_msg("child", new, "tree", rid="root", replace=True))
    driver.run()
    results = driver.results()
    parent = results["root"]
    assert parent.finished_reason["type"] == "abort" and 0 < len(parent.tokens) < 200
    child = results["child"]
    assert child.finished_reason["type"] == "length"
    assembled = root + parent.tokens + new
    assert child.prompt_tokens == len(assembled)
    assert child.tokens == plain_tokens(driver, assembled, 6)
    # The new request hangs under the aborted one: appending to it continues both.
    driver.send(turn_msg("grandchild", new, "tree", rid="child"))
    driver.run()
    grandchild = driver.results()["grandchild"]
    assert grandchild.prompt_tokens == len(assembled) + 6 + len(new)
    assert_idle_and_accounted(driver)


def test_a_retracted_turn_keeps_its_slot_and_its_retry_resumes_it(llama_path, tmp_path):
    """Decode runs out of KV: the session's turn (the most tokens left) is retracted. Its KV
    stays with the session (in its slot, or in the session store when the same pressure takes
    the slot), the retry resumes it and computes only its last token, and the turn's output
    equals the same conversation on a roomy pool."""
    first, turn2, *plains = make_prompts(VOCAB_SIZE, (24, 6, 20, 22, 26), seed=14)
    outputs = []
    for pool in (4096, 200):
        driver = SchedulerDriver(llama_path, enable_streaming_session=True,
                                 max_total_tokens=pool, schedule_conservativeness=0.02,
                                 session_store=str(tmp_path / str(pool)))
        sched = driver.scheduler
        cache = sched.tree_cache
        open_session(driver, "s")
        driver.send(turn_msg("t1", first, "s", max_new_tokens=4))
        driver.run()
        history = first + driver_tokens(driver, "t1")
        for i, ids in enumerate(plains):
            driver.submit(f"p{i}", ids, ignore_eos=True, max_new_tokens=30)
        driver.send(turn_msg("t2", turn2, "s", max_new_tokens=60))
        retracted, resumed = None, False
        while sched.step():
            waiting = [r for r in sched.waiting_queue if r.rid == "t2" and r.is_retracted]
            if retracted is None and waiting:
                kept = waiting[0].all_ids[:-1]
                slot, stored = cache.slots.get("s"), cache.store.get("s")
                assert (slot is not None and slot.token_ids == kept) or (
                    stored is not None and stored.kv_token_ids == kept
                ), "the retracted turn's KV stays with its session"
                assert (slot.history if slot is not None else stored.token_ids) == history
                retracted = len(kept)
            running = [r for r in sched.running_batch.reqs if r.rid == "t2" and r.is_retracted]
            if retracted is not None and running and not resumed:
                node = running[0].last_node
                assert isinstance(node, SessionNode) and node.prefix_len == retracted
                resumed = True
        results = driver.results()
        assert results["t2"].finished_reason["type"] == "length"
        outputs.append(results["t2"].tokens)
        if pool == 200:
            assert resumed, "the turn was not retracted and resumed"
        assert_idle_and_accounted(driver)
    assert outputs[1] == outputs[0]


def driver_tokens(driver: SchedulerDriver, rid: str) -> list[int]:
    """Tokens ``rid`` generated, from the outputs sent so far (without consuming them)."""
    return [t for batch in driver.outputs for o in batch.outputs if o.rid == rid
            for t in o.new_token_ids]


def test_the_busy_check_raises_at_the_step_after_a_leak(llama_path):
    driver = SchedulerDriver(llama_path, enable_streaming_session=True)
    (prompt,) = make_prompts(VOCAB_SIZE, (12,), seed=15)
    driver.submit("r", prompt, ignore_eos=True, max_new_tokens=20)
    driver.scheduler.step()
    driver.scheduler.step()
    assert driver.scheduler.allocator.alloc(1) is not None  # a slot nobody accounts for
    with pytest.raises(RuntimeError, match="memory leak detected"):
        driver.scheduler.step()

