"""The hierarchical cache end to end (real Engine processes, tiny fp32 model, CPU): a prefix the
device pool evicted comes back from the host tier or from storage with the output of a cold
prefill, counted in ``cached_tokens`` and its per-tier ``cached_tokens_details``; a restart
reuses the storage tier; another model's blocks are refused; aborts under KV pressure leak
nothing in any tier (the children run the strict memory check, tiers included)."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine
from tests.checkpoints import build_checkpoint
from tests.engine.conftest import wait_idle

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
DEVICE_TOKENS = 512  # the device pool holds about two documents


def doc(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def engine_kwargs(model, storage=None, **extra):
    kwargs = {"model_path": str(model), "device": "cpu", "dtype": "float32",
              "max_total_tokens": DEVICE_TOKENS, "max_running_requests": 8, "page_size": 4,
              "enable_hierarchical_cache": True, "hicache_ratio": 4.0, **extra}
    if storage is not None:
        kwargs.update(hicache_storage_backend="file", hicache_storage_dir=str(storage))
    return kwargs


def ask(engine, ids):
    return engine.generate(input_ids=ids, sampling_params=GREEDY)


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("hicache-storage")


@pytest.fixture(scope="module")
def cold(llama_path):
    """Greedy outputs of every document on a plain engine (no hierarchy): the reference."""
    with Engine(**engine_kwargs(llama_path, enable_hierarchical_cache=False)) as eng:
        return {seed: ask(eng, doc(seed) + [7, seed])["output_ids"] for seed in range(4)}


def test_an_evicted_prefix_comes_back_from_the_host_as_a_cold_prefill(
    llama_path, storage, cold, strict_env
):
    with Engine(**engine_kwargs(llama_path, storage, hicache_write_policy="write_back")) as eng:
        first = ask(eng, doc(0) + [7, 0])
        assert first["output_ids"] == cold[0]
        assert first["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0,
                                                                "storage": 0}
        for seed in (1, 2, 3):  # three more documents push the first out of the device pool
            assert ask(eng, doc(seed) + [7, seed])["output_ids"] == cold[seed]
        again = ask(eng, doc(0) + [7, 0])
        assert again["output_ids"] == cold[0]
        details = again["meta_info"]["cached_tokens_details"]
        assert details["host"] >= 192, details
        assert again["meta_info"]["cached_tokens"] == sum(details.values())
        state = wait_idle(eng)
        memory = state["memory"]
        assert memory["host_kv_tokens"] > 0 and memory["storage_kv_tokens"] > 0
        assert state["last_leak_check"]["ok"], state["last_leak_check"]


def test_a_restart_reuses_the_storage_tier(llama_path, storage, cold, strict_env):
    """The engine of the test above wrote its documents' blocks to ``storage``."""
    with Engine(**engine_kwargs(llama_path, storage)) as eng:
        out = ask(eng, doc(0) + [7, 0])
        assert out["output_ids"] == cold[0]
        details = out["meta_info"]["cached_tokens_details"]
        assert details["storage"] >= 192 and details["host"] == 0, details
        assert out["meta_info"]["cached_tokens"] >= 192


def test_another_models_storage_is_refused_and_recomputed(
    llama_path, storage, cold, tmp_path, strict_env
):
    other = build_checkpoint(tmp_path / "other", "llama", seed=1)
    with Engine(**engine_kwargs(other, enable_hierarchical_cache=False)) as eng:
        reference = ask(eng, doc(0) + [7, 0])["output_ids"]
    assert reference != cold[0]  # the other weights answer differently
    with Engine(**engine_kwargs(other, storage)) as eng:
        out = ask(eng, doc(0) + [7, 0])
        assert out["output_ids"] == reference
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 0


def test_aborts_under_kv_pressure_leak_nothing_in_any_tier(llama_path, cold, strict_env):
    rng = random.Random(0)
    # inside the session-aware cache: the composition is checked by the same strict check
    with Engine(**engine_kwargs(llama_path, hicache_ratio=2.0,
                                enable_streaming_session=True)) as eng:
        for round_ in range(2):
            streams = []
            for i in range(8):
                seed = rng.randrange(4)
                params = dict(GREEDY)
                if i % 3 == 0:  # runs until closed: aborted mid-decode
                    params["max_new_tokens"] = 300  # closed after its first chunk
                streams.append((seed, i % 3 == 0, eng.generate(
                    input_ids=doc(seed) + [7, seed], sampling_params=params, stream=True,
                    rid=f"r{round_}-{i}")))
            for _, aborted, stream in streams:  # the long ones first: abort mid-decode
                if aborted:
                    next(stream)
                    stream.close()
            for seed, aborted, stream in streams:
                if not aborted:
                    assert list(stream)[-1]["output_ids"] == cold[seed]
            state = wait_idle(eng)
            assert state["last_leak_check"]["ok"], state["last_leak_check"]
        memory = state["memory"]
        assert memory["hicache_loaded_host_tokens"] > 0  # the host tier served some of them
        assert memory["protected_kv_tokens"] == 0
