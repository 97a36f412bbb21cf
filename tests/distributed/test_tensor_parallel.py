"""``--tp-size 2`` on CPU (gloo, one thread per rank), on every test architecture.

Each architecture's engine runs the scenario of ``conftest.py``: chunked prefill, retraction and
a radix-cache hit, greedy with logprobs. Outputs equal transformers' and the one-process
scheduler's token for token; both ranks took every decision together (a disagreement between
their schedulers would end in mismatched collectives, not in outputs). A decoder served as an
embedder gives transformers' vectors on two ranks too.
"""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.model_config import ModelConfig
from tests.checkpoints import ARCHITECTURES
from tests.distributed.conftest import SCENARIO_ARGS, check_scenario, run_scenario
from tests.embeddings.test_decoder_embedding import assert_close, hf_last_token_embeddings
from tests.managers.conftest import make_prompts


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
