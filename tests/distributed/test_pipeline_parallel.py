"""``--pp-size 2`` on CPU: two stages, micro-batches in flight, greedy as one process.

The scenario of ``conftest.py`` runs on two architectures (Llama; Qwen3 with tied embeddings,
so the last stage loads the embedding tensor into its LM head). Prefill chunks of 16 tokens
admit the batch over several steps, into both micro-batches, so the stages overlap
(``num_pipelined_steps``).
"""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.model_config import ModelConfig
from tests.distributed.conftest import SCENARIO_ARGS, check_scenario, run_scenario


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pp_run(request, checkpoint_factory, strict_env):
    path = checkpoint_factory(request.param)
    vocab = ModelConfig.from_path(path, dtype="float32", device="cpu").vocab_size
    with Engine(path, device="cpu", dtype="float32", pp_size=2, **SCENARIO_ARGS) as engine:
        return path, run_scenario(engine, path, vocab)


def test_pp2_greedy_equals_transformers_and_one_process(pp_run):
    path, run = pp_run
    check_scenario(run, path)


def test_pp2_keeps_both_stages_busy_with_micro_batches(pp_run):
    _, run = pp_run
    assert run["state"]["num_pipelined_steps"] > 0
