"""More adapters loaded than slots (``--max-loaded-loras`` above ``--max-loras-per-batch``, as
SGLang): a batch's adapters take slots when the scheduler admits its requests, evicting adapters
no running request uses (least recently used, or first placed with ``fifo``), and a request whose
adapter does not fit waits. Outputs stay ``peft``'s, token for token."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.lora.lora_manager import LoRAManager, resolve_settings
from radixserve.model_config import ModelConfig
from radixserve.server_args import ServerArgs
from tests.engine.conftest import ENGINE_KWARGS, wait_idle
from tests.lora.adapters import make_adapter, peft_greedy

MAX_NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = [[5, 17, 33, 90], [44, 45, 46, 47], [300, 12, 8, 99], [9, 19, 29, 39], [7, 8, 9, 10],
           [61, 62, 63, 64]]
TARGETS = [["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["o_proj", "up_proj"],
           ["k_proj", "q_proj", "down_proj"]]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("slot-adapters")
    return {f"a{i}": make_adapter(llama_path, root / f"a{i}", 4, TARGETS[i], seed=40 + i)
            for i in range(4)}


def _manager(llama_path, adapters, policy):
    config = ModelConfig.from_path(llama_path, dtype="float32", device="cpu")
    settings = resolve_settings(2, 4, None, {}, max_loaded_loras=4,
                                lora_eviction_policy=policy)
    manager = LoRAManager(config, range(config.num_hidden_layers), settings,
                          torch.device("cpu"), torch.float32)
    for name, path in adapters.items():
        manager.load(name, str(path))
    return manager


@pytest.mark.parametrize(("policy", "victim"), [("lru", "a1"), ("fifo", "a0")])
def test_slots_go_to_the_batchs_adapters_evicting_by_policy(llama_path, adapters, policy, victim):
    manager = _manager(llama_path, adapters, policy)
    assert manager.slot_of == {"a0": 0, "a1": 1}  # placed at load while slots were free
    manager.ensure_slots({"a0"})  # a0 used again: under lru, a1 is now the older
    slots = manager.ensure_slots({"a2"})
    assert manager.slot_of.get(victim) is None and slots["a2"] in (0, 1)
    kept = ({"a0", "a1"} - {victim}).pop()
    assert kept in manager.slot_of
    # the slot holds a2's weights now: its pool rows equal a fresh placement's
    fresh = _manager(llama_path, {"a2": adapters["a2"]}, policy)
    for key, buf in manager.pool.buffers.items():
        assert torch.equal(buf.a[slots["a2"]], fresh.pool.buffers[key].a[0]), key
        assert torch.equal(buf.b[slots["a2"]], fresh.pool.buffers[key].b[0]), key
    # adapters of the batch keep their slots
    assert manager.ensure_slots({"a2", kept}) == {"a2": slots["a2"], kept: manager.slot_of[kept]}


def test_max_loaded_loras_is_checked():
    with pytest.raises(ValueError, match="max_loaded_loras .1. must be >= max_loras_per_batch"):
        ServerArgs(model_path="m", enable_lora=True, max_loras_per_batch=2, max_loaded_loras=1)
    with pytest.raises(ValueError, match="lora_eviction_policy"):
        ServerArgs(model_path="m", enable_lora=True, lora_eviction_policy="random")
    with pytest.raises(ValueError, match="max_loaded_loras need --enable-lora"):
        ServerArgs(model_path="m", max_loaded_loras=4)
    ServerArgs(model_path="m", lora_paths=["a=/x", "b=/y", "c=/z"], max_loras_per_batch=2,
               max_loaded_loras=3)


@pytest.mark.processes
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_four_adapters_through_two_slots_match_peft(llama_path, adapters, overlap, strict_env):
    names = ["a0", "a1", None, "a2", "a3", "a1"]
    with Engine(model_path=str(llama_path), dtype="float32", max_loras_per_batch=2,
                max_loaded_loras=4, lora_paths=[f"{n}={p}" for n, p in adapters.items()],
                max_lora_rank=4, enable_overlap_schedule=overlap, **ENGINE_KWARGS) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=names)
        with pytest.raises(ValueError, match="4 LoRA adapters are loaded"):
            engine.load_lora_adapter("fifth", str(adapters["a0"]))
        wait_idle(engine)
    paths = {**adapters, None: None}
    expected = [peft_greedy(llama_path, paths[n], p, MAX_NEW)
                for n, p in zip(names, PROMPTS, strict=True)]
    assert [o["output_ids"] for o in out] == expected
