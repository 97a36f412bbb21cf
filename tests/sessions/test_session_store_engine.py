"""The session store through the offline ``Engine``, on the plain and the overlap schedule.

An idle streaming session goes to the store after ``session_offload_after`` seconds; its next
turn restores it (``cached_tokens``: the whole history but its last token) and continues as a
plain request on the same ids. ``Engine.shutdown`` writes the open session out, and a second
Engine on the same store resumes it (``open_session(..., resume=True)``) with its KV.

The store writes through the storage tier's file format (``mem_cache/kv_file.py``). With
``kv_cache_dtype="int8"`` the codes and their scales make the trip; under
``enable_deterministic_inference`` a decoded token's KV has a cold prefill's bits, so a restored
turn must give, logprobs included, exactly what a plain request that never met the store gives.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS, engine_state, wait_idle
from tests.layers.helpers import needs_kernels
from tests.sessions.conftest import BUSY_CHECK, random_ids, sampling
from tests.sync import wait_for

N = 6


# Two Engines per case: the overlap schedule shares its case with the int8 cache (the suite's
# time is tight; the store's code is the same for every dtype and both schedules).
CASES: dict[str, dict[str, Any]] = {
    "plain": {"enable_overlap_schedule": False},
    "overlap-int8": {"enable_overlap_schedule": True, "kv_cache_dtype": "int8",
                     "enable_deterministic_inference": True},
}


def store_engine(llama_path: Path, store: Path, case: str, **extra: Any) -> Engine:
    return Engine(model_path=str(llama_path), enable_streaming_session=True,
                  session_store=str(store), **CASES[case], **ENGINE_KWARGS, **extra)


class EngineChat:
    """A streaming session on an Engine, and the history it should hold."""

    def __init__(self, engine: Engine, session_id: str, history: list[int] | None = None,
                 exact: bool = False):
        self.engine, self.id = engine, session_id
        self.history = list(history or [])
        self.exact = exact  # the logprobs too, bit for bit

    def turn(self, rng: random.Random) -> dict[str, Any]:
        """One turn, checked against a plain request on the assembled ids."""
        new = random_ids(rng, 5)
        out = self.engine.generate(input_ids=new, sampling_params=sampling(N),
                                   session_params={"id": self.id}, return_logprob=self.exact)
        assembled = self.history + new
        plain = self.engine.generate(input_ids=assembled, sampling_params=sampling(N),
                                     return_logprob=self.exact)
        assert out["meta_info"]["prompt_tokens"] == len(assembled)
        assert out["output_ids"] == plain["output_ids"]
        if self.exact:
            got, want = (o["meta_info"]["output_token_logprobs"] for o in (out, plain))
            assert got == want, "restored KV is not the KV a cold prefill computes"
        self.history = assembled + out["output_ids"]
        return out


def offloaded(engine: Engine) -> int:
    return engine_state(engine)["memory"]["session_offloaded_tokens"]


# the int8 case is deterministic: batch-invariant attention, the cpu backend's (AVX-512) kernels
@pytest.mark.parametrize("case", ["plain", pytest.param("overlap-int8", marks=needs_kernels)])
def test_engine_offloads_restores_and_resumes_a_session_across_engines(
    llama_path, tmp_path, monkeypatch, case,
):
    for name, value in {**BUSY_CHECK, "RADIXSERVE_TEST_STRICT": "1"}.items():
        monkeypatch.setenv(name, value)  # the Engine's children inherit it: a leak raises
    store = tmp_path / "store"
    rng = random.Random(f"engine-store-{case}")
    exact = "kv_cache_dtype" in CASES[case]
    with store_engine(llama_path, store, case, session_offload_after=0.2) as engine:
        assert engine.open_session(4096, session_id="chat", streaming=True) == "chat"
        chat = EngineChat(engine, "chat", exact=exact)
        chat.turn(rng)
        for _ in range(2):
            # Idle past session_offload_after: the slot's KV goes to the store, out of the pool.
            held = len(chat.history) - 1
            wait_for(lambda: offloaded(engine), lambda tokens, held=held: tokens == held,
                     "the idle session offloaded")
            memory = wait_idle(engine)["memory"]
            assert memory["session_held_kv_tokens"] == memory["protected_kv_tokens"] == 0
            out = chat.turn(rng)
            assert out["meta_info"]["cached_tokens"] == held, "restored, not recomputed"
        history = chat.history
    # The first Engine's shutdown wrote the session out; a second one resumes it.
    with store_engine(llama_path, store, case) as engine:
        assert engine.open_session(4096, session_id="chat", streaming=True, resume=True) == "chat"
        assert offloaded(engine) == len(history) - 1
        chat = EngineChat(engine, "chat", history, exact=exact)
        out = chat.turn(rng)
        assert out["meta_info"]["cached_tokens"] == len(history) - 1
        engine.close_session("chat")
        memory = wait_idle(engine)["memory"]
        assert memory["session_offloaded_tokens"] == memory["session_held_kv_tokens"] == 0
    assert list(store.iterdir()) == [], "closing the session deleted its file"
