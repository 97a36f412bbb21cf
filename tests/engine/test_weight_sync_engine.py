"""``Engine.update_weights_from_tensor``: a second checkpoint's tensors handed over in shared
memory replace the weights (greedy output then equals ``transformers`` on that checkpoint, token
for token); a wrong name, shape or dtype raises ``ValueError`` naming it and the old weights
keep serving; ``flush_cache`` as SGLang: True drops the prefix cache, False keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from radixserve import Engine
from tests.checkpoints import build_checkpoint
from tests.engine.conftest import ENGINE_KWARGS, wait_idle
from tests.server.test_operations_http import PROMPT_IDS, hf_greedy

NAME = "model.layers.0.mlp.down_proj.weight"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module")
def llama_b(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-llama-b"), "llama", seed=1)


@pytest.fixture(scope="module")
def engine(strict_env, llama_path):
    with Engine(str(llama_path), dtype="float32", **ENGINE_KWARGS) as eng:
        yield eng


def run(engine) -> dict:
    return engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)


def test_update_weights_from_tensor(engine, llama_path, llama_b):
    expected_a, expected_b = hf_greedy(llama_path), hf_greedy(llama_b)
    assert expected_a != expected_b
    assert run(engine)["output_ids"] == expected_a
    b = tensors_of(llama_b)
    good = b[NAME]
    bad = [
        ([("model.layers.0.mlp.nope.weight", good)], "nope"),
        ([(NAME, torch.zeros(3, 3))], "shape [3, 3]"),
        ([(NAME, good.to(torch.int32))], "int32"),
        ([(NAME, good), ("lm_head.bias", torch.zeros(4))], "lm_head.bias"),  # none written
    ]
    for named, needle in bad:
        with pytest.raises(ValueError, match="weights not updated") as info:
            engine.update_weights_from_tensor(named)
        assert needle in str(info.value)
        assert run(engine)["output_ids"] == expected_a

    reply = engine.update_weights_from_tensor(list(b.items()))  # flush_cache=True
    assert reply["success"] and "cache flushed" in reply["message"]
    after = run(engine)
    assert after["output_ids"] == expected_b
    assert after["meta_info"]["cached_tokens"] == 0  # nothing of A's KV survived

    # bf16 tensors are converted into the served float32 weights; flush_cache=False keeps the
    # (now stale) cached prefix, as SGLang does between a trainer's buckets.
    a = {name: t.to(torch.bfloat16) for name, t in tensors_of(llama_path).items()}
    engine.update_weights_from_tensor(list(a.items()), flush_cache=False)
    assert run(engine)["meta_info"]["cached_tokens"] > 0
    wait_idle(engine)
    assert engine.flush_cache()["success"]
    fresh = run(engine)
    assert fresh["meta_info"]["cached_tokens"] == 0
    rounded = {name: t.float() for name, t in a.items()}
    engine.update_weights_from_tensor(list(rounded.items()))
    assert run(engine)["output_ids"] == fresh["output_ids"]  # bf16 in = its float32 value
    with pytest.raises(ValueError, match="load_format"):
        engine.update_weights_from_tensor([(NAME, good)], load_format="dummy")
    wait_idle(engine)
