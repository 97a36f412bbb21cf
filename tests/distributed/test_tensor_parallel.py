"""``--tp-size 2`` on CPU (gloo, one thread per rank), on every test architecture.

Each architecture's engine runs the scenario of ``conftest.py``: chunked prefill, retraction and
a radix-cache hit, greedy with logprobs. Outputs equal transformers' and the one-process
scheduler's token for token; both ranks took every decision together (a disagreement between
their schedulers would end in mismatched collectives, not in outputs). A decoder served as an
embedder gives transformers' vectors on two ranks too.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from radixserve import Engine
from radixserve.model_config import ModelConfig
from tests.checkpoints import ARCHITECTURES
from tests.constrained.schemas import REGEXES, WHITESPACE_CNT
from tests.distributed.conftest import SCENARIO_ARGS, check_scenario, run_scenario
from tests.embeddings.test_decoder_embedding import assert_close, hf_last_token_embeddings
from tests.managers.conftest import SchedulerDriver, make_prompts
from tests.managers.test_constrained_decoding import SCHEMA


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tp_run(request, checkpoint_factory, strict_env):
    path = checkpoint_factory(request.param)
    vocab = ModelConfig.from_path(path, dtype="float32", device="cpu").vocab_size
    with Engine(path, device="cpu", dtype="float32", tp_size=2, **SCENARIO_ARGS) as engine:
        info = engine.get_server_info()
        return path, info, run_scenario(engine, path, vocab)


def test_tp2_greedy_equals_transformers_and_one_process(tp_run):
    path, _, run = tp_run
    check_scenario(run, path)


def test_tp2_runs_two_scheduler_ranks_with_the_agreed_kv_pool(tp_run):
    _, info, run = tp_run
    assert info["tp_size"] == 2
    assert info["max_total_num_tokens"] == SCENARIO_ARGS["max_total_tokens"]
    assert run["state"]["memory"]["total_kv_tokens"] == SCENARIO_ARGS["max_total_tokens"]


def test_tp2_decoder_embeddings_match_transformers(llama_path, strict_env):
    prompts = make_prompts(500, lens=(3, 17, 40), seed=5)
    with Engine(llama_path, device="cpu", dtype="float32", is_embedding=True, tp_size=2,
                max_total_tokens=1024) as engine:
        assert_close(engine.encode(input_ids=prompts), hf_last_token_embeddings(llama_path,
                                                                                  prompts))


def test_tp2_grammars_and_a_pause_hold_on_both_ranks(llama_path, strict_env):
    """Each rank compiles the grammars itself; a step waits for them, so both admit the
    constrained requests at the same step. A pause reaches both ranks: requests sent while
    paused wait (a rank that stepped alone would hang in its collective) and run on continue.
    Outputs equal the one-process scheduler's."""
    prompts = make_prompts(512, (5, 12, 30), seed=7)
    constraints = [{"json_schema": json.dumps(SCHEMA)}, {"regex": REGEXES[1]}, {}]
    greedy = {"temperature": 0.0, "max_new_tokens": 64}
    outs: list = []
    with Engine(llama_path, device="cpu", dtype="float32", tp_size=2, max_total_tokens=1024,
                constrained_json_max_whitespace_cnt=WHITESPACE_CNT) as engine:
        engine.pause_generation("in_place")
        sender = threading.Thread(target=lambda: outs.extend(engine.generate(
            input_ids=prompts, sampling_params=[{**greedy, **c} for c in constraints])))
        sender.start()
        deadline = time.monotonic() + 120
        while True:
            (state,) = engine.get_server_info()["internal_states"]
            if state["num_waiting_reqs"] == len(prompts):
                break
            assert time.monotonic() < deadline and sender.is_alive(), state
            time.sleep(0.05)
        assert state["paused"] and state["num_running_reqs"] == 0
        engine.continue_generation()
        sender.join(300)
        assert not sender.is_alive(), "the requests did not finish after continue"
    driver = SchedulerDriver(llama_path, max_total_tokens=1024,
                             constrained_json_max_whitespace_cnt=WHITESPACE_CNT)
    for prompt, constraint, out in zip(prompts, constraints, outs, strict=True):
        expected = driver.generate({"p": prompt}, **greedy, **constraint)["p"]
        assert out["output_ids"] == expected.tokens, constraint
