"""LoRA under ``--tp-size 2`` (gloo, CPU): each rank holds its part of every adapter (B's rows of
a column-parallel layer, A's columns of a row-parallel one, whose intermediate is summed over the
ranks), and a batch mixing two adapters and the base model decodes greedily what ``peft``
decodes, token for token. Also with one KV head replicated on both ranks."""

from __future__ import annotations

import pytest

from radixserve import Engine
from tests.checkpoints import build_checkpoint
from tests.engine.conftest import ENGINE_KWARGS
from tests.lora.adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.processes

MAX_NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = [[5, 17, 33, 90, 120, 7], [44, 45, 46, 47], [300, 12, 8, 99, 100]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tp2_mixed_adapters_match_peft(kv_heads, tmp_path, strict_env):
    base = build_checkpoint(tmp_path / "base", "llama", seed=3, num_key_value_heads=kv_heads)
    one = make_adapter(base, tmp_path / "one", 4, ALL, seed=31)
    two = make_adapter(base, tmp_path / "two", 8, ["q_proj", "v_proj", "down_proj"], seed=32,
                       alpha=8)
    names = ["one", None, "two"]
    with Engine(model_path=str(base), dtype="float32", tp_size=2, max_loras_per_batch=2,
                lora_paths=[f"one={one}", f"two={two}"], max_lora_rank=8,
                **ENGINE_KWARGS) as engine:
        assert engine.get_server_info()["tp_size"] == 2
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=names)
    paths = {"one": one, "two": two, None: None}
    expected = [peft_greedy(base, paths[n], p, MAX_NEW) for n, p in zip(names, PROMPTS,
                                                                        strict=True)]
    assert [o["output_ids"] for o in out] == expected
    plain = [peft_greedy(base, None, p, MAX_NEW) for p in (PROMPTS[0], PROMPTS[2])]
    assert out[0]["output_ids"] != plain[0] and out[2]["output_ids"] != plain[1]
