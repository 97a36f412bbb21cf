"""The Engine's operator methods (the same as the HTTP control routes) on one Engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.managers.tokenizer.request_state import ServiceUnavailableError
from tests.checkpoints import build_checkpoint
from tests.engine.conftest import ENGINE_KWARGS, wait_idle

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_engine_operations(llama_path, tmp_path, strict_env):
    other = build_checkpoint(tmp_path / "b", "llama", seed=1)
    with Engine(llama_path, dtype="float32", **ENGINE_KWARGS) as engine:
        ids_a = engine.generate(input_ids=[5, 9, 33], sampling_params=PARAMS)["output_ids"]
        assert engine.update_weights_from_disk(str(other))["success"]
        ids_b = engine.generate(input_ids=[5, 9, 33], sampling_params=PARAMS)["output_ids"]
        assert ids_b != ids_a
        with pytest.raises(ValueError, match="not found"):
            engine.update_weights_from_disk(str(tmp_path / "missing"))
        assert engine.update_weights_from_disk(str(llama_path))["success"]
        assert engine.generate(input_ids=[5, 9, 33], sampling_params=PARAMS)["output_ids"] == ids_a

        rows = engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", 2)
        assert len(rows) == 2 and len(rows[0]) == 64
        with pytest.raises(ValueError, match="no parameter"):
            engine.get_weights_by_name("nope")

        engine.release_memory_occupation(["kv_cache"])
        with pytest.raises(ServiceUnavailableError, match="released"):
            engine.generate("hi", PARAMS)
        engine.resume_memory_occupation(["kv_cache"])
        assert engine.generate(input_ids=[5, 9, 33], sampling_params=PARAMS)["output_ids"] == ids_a

        trace = engine.start_profile(output_dir=str(tmp_path / "prof"))["trace_path"]
        engine.generate("profile me", PARAMS)
        assert engine.stop_profile()["trace_path"] == trace
        assert json.loads(Path(trace).read_text())["traceEvents"]

        assert engine.set_internal_state({"max_prefill_tokens": 64})["max_prefill_tokens"] == 64
        with pytest.raises(ValueError, match="settable"):
            engine.set_internal_state({"nope": 1})
        engine.slow_down(0.01)
        engine.generate("slow", PARAMS)
        engine.slow_down(None)
        assert engine.freeze_gc()["scheduler"] > 0
        load = engine.get_load()
        assert load[0]["num_reqs"] == 0 and load[0]["max_total_num_tokens"] == 8192
        state = engine.get_inspector_state()
        assert state["stats"]["num_steps"] > 0 and state["history"][-1]["kind"] == "decode"
        assert state["radix_tree"]["nodes"] and state["memory"]["total_kv_tokens"] == 8192
        wait_idle(engine)
