"""``--tp-size 2`` on CPU (gloo) for the newer families: Gemma 2 (sliding window, soft caps),
Mixtral (experts split over the ranks by intermediate size, one reduction per MoE layer) and
Qwen2-MoE (plus its shared expert). The scenario of ``conftest.py`` (chunked prefill,
retraction, a radix-cache hit, greedy with logprobs) gives transformers' and the one-process
scheduler's tokens."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.model_config import ModelConfig
from tests.checkpoints import build_checkpoint
from tests.distributed.conftest import SCENARIO_ARGS, check_scenario, run_scenario


@pytest.mark.parametrize("arch", ["gemma2", "mixtral", "qwen2_moe"])
def test_tp2_new_families_equal_transformers_and_one_process(arch, tmp_path, strict_env):
    path = build_checkpoint(tmp_path / arch, arch)
    vocab = ModelConfig.from_path(path, dtype="float32", device="cpu").vocab_size
    with Engine(path, device="cpu", dtype="float32", tp_size=2, **SCENARIO_ARGS) as engine:
        assert engine.get_server_info()["tp_size"] == 2
        run = run_scenario(engine, path, vocab)
    check_scenario(run, path)
