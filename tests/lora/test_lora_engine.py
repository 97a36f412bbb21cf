"""Multi-LoRA serving end to end through the real processes (Engine → scheduler → model).

Adapters made with ``peft`` (random non-zero A and B, ranks 2, 4 and 8, different target sets,
one rsLoRA) on the tiny random Llama; greedy fp32 output must equal ``peft``'s model with the
same adapter, token for token, for one batch that mixes three adapters and the base model."""

from __future__ import annotations

import pytest

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS, engine_state, wait_idle
from tests.lora.adapters import make_adapter, peft_greedy
from tests.sync import UNTIL_ABORTED

MAX_NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = [[5, 17, 33, 90, 120, 7], [44, 45, 46, 47], [300, 12, 8, 99, 100, 101, 102],
           [9, 19, 29, 39, 49]]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": make_adapter(llama_path, root / "attn", 4, ["q_proj", "k_proj", "v_proj",
                                                             "o_proj"], seed=11),
        "mlp": make_adapter(llama_path, root / "mlp", 8, ["gate_proj", "up_proj", "down_proj"],
                            seed=12, alpha=4),
        "mixed": make_adapter(llama_path, root / "mixed", 2, ["q_proj", "v_proj", "down_proj"],
                              seed=13, alpha=8, use_rslora=True),
        "spare": make_adapter(llama_path, root / "spare", 4, ["o_proj", "up_proj"], seed=14),
    }


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def engine(request, llama_path, adapters, strict_env):
    """Every test runs on the plain schedule and on the overlap schedule (the step runs in the
    worker thread while the next is planned)."""
    paths = [f"{name}={adapters[name]}" for name in ("attn", "mlp", "mixed")]
    with Engine(model_path=str(llama_path), dtype="float32", lora_paths=paths,
                max_loras_per_batch=4, max_lora_rank=8, enable_streaming_session=True,
                enable_overlap_schedule=request.param, **ENGINE_KWARGS) as eng:
        yield eng


def _tokens(out):
    return [o["output_ids"] for o in out]


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(engine, adapters, llama_path):
    names = ["attn", None, "mlp", "mixed"]
    out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=names)
    expected = [peft_greedy(llama_path, adapters[n] if n else None, p, MAX_NEW)
                for n, p in zip(names, PROMPTS, strict=True)]
    assert _tokens(out) == expected
    # the adapters change the output: the test would catch a LoRA op that does nothing
    base = [peft_greedy(llama_path, None, p, MAX_NEW) for p in PROMPTS]
    assert all(out[i]["output_ids"] != base[i] for i in (0, 2, 3))


def test_the_same_prompt_under_two_adapters_shares_no_cache(engine):
    prompt = list(range(40, 72))
    engine.flush_cache()
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="attn")
    assert first["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="attn")
    assert again["meta_info"]["cached_tokens"] >= 31  # the same adapter reuses its KV
    other = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="mlp")
    assert other["meta_info"]["cached_tokens"] == 0
    base = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert base["meta_info"]["cached_tokens"] == 0


def test_unknown_adapter_is_refused(engine):
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope' is loaded"):
        engine.generate(input_ids=[5, 6], sampling_params=GREEDY, lora_path="nope")


def _no_leak(engine):
    state = wait_idle(engine)
    m = state["memory"]
    held = m["available_kv_tokens"] + m["evictable_kv_tokens"] + m["protected_kv_tokens"]
    assert held == m["total_kv_tokens"] and m["protected_kv_tokens"] == 0, m
    assert m["free_req_slots"] == m["total_req_slots"], m
    assert state["last_leak_check"]["ok"], state["last_leak_check"]


def test_load_serve_unload_reload_without_leak(engine, adapters, llama_path):
    prompt = PROMPTS[0]
    loaded = engine.load_lora_adapter("spare", str(adapters["spare"]))["loaded_adapters"]
    assert set(loaded) == {"attn", "mlp", "mixed", "spare"}
    with pytest.raises(ValueError, match="4 LoRA adapters are loaded"):
        engine.load_lora_adapter("fifth", str(adapters["spare"]))
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="spare")
    assert out["output_ids"] == peft_greedy(llama_path, adapters["spare"], prompt, MAX_NEW)
    assert set(engine.unload_lora_adapter("spare")["loaded_adapters"]) == {"attn", "mlp",
                                                                            "mixed"}
    with pytest.raises(ValueError, match="no LoRA adapter named 'spare'"):
        engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="spare")
    _no_leak(engine)
    # reloaded under the same name (into a free slot): same output, and no KV of the old load
    engine.load_lora_adapter("spare", str(adapters["spare"]))
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="spare")
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 0
    engine.unload_lora_adapter("spare")
    _no_leak(engine)


def test_unloading_an_adapter_in_use_is_refused(engine, adapters):
    params = {"temperature": 0.0, "max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}
    stream = engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=True,
                             rid="lora-busy", lora_path="mixed")
    next(stream)
    with pytest.raises(ValueError, match="'mixed' is in use by 1 running or waiting"):
        engine.unload_lora_adapter("mixed")
    stream.close()  # aborts it
    wait_idle(engine)
    assert "mixed" not in engine.unload_lora_adapter("mixed")["loaded_adapters"]
    engine.load_lora_adapter("mixed", str(adapters["mixed"]))  # as the module's other tests
    assert engine_state(engine)["num_running_reqs"] == 0


def test_bad_folders_are_refused_with_the_reason(engine, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        engine.load_lora_adapter("bad", str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine.load_lora_adapter("bad", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("attn", str(tmp_path / "empty"))


def _turn(engine, session_id, new_ids, lora_path, rid=None):
    params = {"id": session_id} if rid is None else {"id": session_id, "rid": rid}
    return engine.generate(input_ids=new_ids, sampling_params=GREEDY, lora_path=lora_path,
                           session_params=params)


def test_a_streaming_session_keeps_its_adapter_kv_apart(engine, adapters, llama_path):
    """Turns under one adapter continue its KV; a turn under another adapter (or the base
    model) recomputes the history under its own (docs/lora.md); each turn equals ``peft``."""
    engine.flush_cache()
    sid = engine.open_session(4096, streaming=True)
    history: list[int] = []
    turns = [("attn", [61, 62, 63, 64, 65, 66, 67]), ("attn", [70, 71, 72]),
             ("mlp", [80, 81]), (None, [90, 91, 92]), (None, [93])]
    for i, (name, new) in enumerate(turns):
        out = _turn(engine, sid, new, name)
        history += new
        assert out["output_ids"] == peft_greedy(
            llama_path, adapters[name] if name else None, history, MAX_NEW), (i, name)
        cached = out["meta_info"]["cached_tokens"]
        if i == 0 or name != turns[i - 1][0]:
            assert cached == 0, (i, name)  # nothing computed under another adapter is reused
        else:
            assert cached >= len(history) - len(new) - 1, (i, name)  # the session's own KV
        history += out["output_ids"]
    engine.close_session(sid)
    # a second session of the same prompt under another adapter reuses none of the first's KV
    other = engine.open_session(4096, streaming=True)
    out = _turn(engine, other, turns[0][1], "mixed")
    assert out["meta_info"]["cached_tokens"] == 0
    engine.close_session(other)
    _no_leak(engine)


def test_a_plain_session_keeps_adapters_apart(engine, adapters, llama_path):
    engine.flush_cache()
    sid = engine.open_session(4096)
    first = _turn(engine, sid, [101, 102, 103, 104, 105, 106, 107, 108], "mixed")
    prompt = [101, 102, 103, 104, 105, 106, 107, 108] + first["output_ids"] + [110, 111]
    same = _turn(engine, sid, [110, 111], "mixed", rid=first["meta_info"]["id"])
    assert same["output_ids"] == peft_greedy(llama_path, adapters["mixed"], prompt, MAX_NEW)
    assert same["meta_info"]["cached_tokens"] >= 8
    other = _turn(engine, sid, [110, 111], "attn", rid=first["meta_info"]["id"])
    assert other["output_ids"] == peft_greedy(llama_path, adapters["attn"], prompt, MAX_NEW)
    assert other["meta_info"]["cached_tokens"] == 0
    engine.close_session(sid)
