"""The session store over HTTP (``--session-store DIR``): a streaming session's KV leaves the
pool for a file instead of being dropped (memory pressure, or idle past
``--session-offload-after``), its next turn restores it (``cached_tokens`` covers the whole
history: nothing recomputed) and continues token for token as a plain request on the same ids;
sessions survive a restart (``open_session`` with ``"resume": true``); stored KV of another
model, or a truncated or corrupt file, is refused and the session re-prefills its token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.checkpoints import build_checkpoint
from tests.server.conftest import ServerProcess, start_server
from tests.sessions.conftest import BUSY_CHECK, SessionAPI, random_ids
from tests.sync import wait_for

N = 6


class StoredChat:
    """A streaming session over HTTP and the history the server should hold for it."""

    def __init__(self, api: SessionAPI, rng: random.Random, session_id: str | None = None,
                 resume_history: list[int] | None = None) -> None:
        self.api, self.rng = api, rng
        self.history: list[int] = list(resume_history or [])
        if resume_history is None:
            body: dict[str, Any] = {} if session_id is None else {"session_id": session_id}
            self.id = api.open(streaming=True, **body)
        else:
            assert session_id is not None
            self.id = session_id

    def turn(self, n_new: int = 5) -> dict:
        """One turn; checks the prompt the server assembled. Returns the output."""
        new = random_ids(self.rng, n_new)
        out = self.api.generate(new, N, self.id)
        assert out["meta_info"]["prompt_tokens"] == len(self.history) + n_new
        self.last_assembled = self.history + new
        self.history = self.last_assembled + out["output_ids"]
        return out

    def check_last(self, out: dict) -> None:
        """The turn equals a plain request on the same ids (greedy)."""
        ref = self.api.generate(self.last_assembled, N)
        assert out["output_ids"] == ref["output_ids"]


def cached(out: dict) -> int:
    return out["meta_info"]["cached_tokens"]


def resume(api: SessionAPI, session_id: str) -> httpx.Response:
    return api.http.post("/open_session", json={
        "capacity_of_str_len": 4096, "session_id": session_id, "streaming": True, "resume": True,
    })


def serve(model: Path, store: Path, *flags: str) -> ServerProcess:
    return start_server(model, "--enable-streaming-session", "--session-store", str(store),
                        *flags, env=BUSY_CHECK)


def http_client(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120)


NAMES = ["intact", "truncated", "corrupt", "bad-header", "second"]


@dataclass
class FirstRun:
    """What the first server left behind: its store and the histories of the sessions that
    were still open when it stopped."""

    store: Path
    histories: dict[str, list[int]]
    offloaded_seen: int
    closed_files_left: list[Path]


@pytest.fixture(scope="module")
def first_run(llama_path, tmp_path_factory) -> FirstRun:
    """Eight sessions on 256 KV tokens (they do not fit at once), three turns each; then three
    of them close and the server stops with the other five open."""
    store = tmp_path_factory.mktemp("session-store")
    server = serve(llama_path, store, "--max-total-tokens", "256")
    try:
        with http_client(server) as http:
            api = SessionAPI(http)
            rng = random.Random(1)
            chats = [StoredChat(api, rng, session_id=name) for name in NAMES]
            chats += [StoredChat(api, rng) for _ in range(3)]
            offloaded_seen = 0
            for _ in range(3):
                for chat in chats:
                    before = len(chat.history)
                    out = chat.turn(n_new=8)
                    if before:
                        # The slot was resident or restored from the store: all reused.
                        assert cached(out) == before - 1
                    offloaded_seen = max(offloaded_seen, api.memory()["session_offloaded_tokens"])
            for chat in chats:
                out = chat.turn()
                chat.check_last(out)
            api.assert_accounted()
            for chat in chats[len(NAMES):]:
                api.close(chat.id)
            closed_files_left = [store / _file_name(chat.id) for chat in chats[len(NAMES):]]
            closed_files_left = [path for path in closed_files_left if path.exists()]
            histories = {chat.id: chat.history for chat in chats[: len(NAMES)]}
    finally:
        server.check_clean_stop()  # SIGTERM: the scheduler writes every open session out
    return FirstRun(store, histories, offloaded_seen, closed_files_left)


def test_memory_pressure_offloads_idle_sessions_and_their_next_turns_restore_them(first_run):
    """(The turns themselves are checked as they run, in ``first_run``.)"""
    assert first_run.offloaded_seen > 0, "nothing went to the store"
    assert first_run.closed_files_left == [], "a closed session's file is deleted"


def test_sessions_survive_a_restart_and_untrustworthy_files_re_prefill(
    llama_path, tmp_path, first_run,
):
    store, histories, names = first_run.store, first_run.histories, NAMES
    rng = random.Random(2)
    files = {name: store / _file_name(name) for name in names}
    assert all(path.exists() for path in files.values())
    _damage(files["truncated"], "truncate")
    _damage(files["corrupt"], "payload")
    _damage(files["bad-header"], "header")

    second = serve(llama_path, store, "--session-offload-after", "0.5")
    try:
        with http_client(second) as http:
            api = SessionAPI(http)
            for name in ["intact", "truncated", "corrupt", "second"]:
                r = resume(api, name)
                assert r.status_code == 200, r.text
                assert r.json() == name
            r = resume(api, "bad-header")
            assert r.status_code == 400 and "cannot resume" in r.json()["error"]["message"]
            for body, words in [
                ({"session_id": "never-stored"}, "no stored session"),
                ({"session_id": "intact"}, "already exists"),
                ({"session_id": "x", "streaming": False}, '"streaming": true'),
                ({}, "give its session_id"),
            ]:
                r = http.post("/open_session", json={
                    "capacity_of_str_len": 4096, "streaming": True, "resume": True, **body,
                })
                assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
            # The sessions wait in the store; a truncated file holds no usable KV (a corrupt
            # payload is found out when it is loaded).
            kv = sum(len(histories[name]) - 1 for name in ["intact", "second", "corrupt"])
            assert api.memory()["session_offloaded_tokens"] == kv
            chats = {name: StoredChat(api, rng, name, histories[name])
                     for name in ["intact", "truncated", "corrupt", "second"]}
            outs = {name: chat.turn() for name, chat in chats.items()}
            assert cached(outs["intact"]) == len(histories["intact"]) - 1
            assert cached(outs["second"]) == len(histories["second"]) - 1
            assert cached(outs["truncated"]) == cached(outs["corrupt"]) == 0, "re-prefilled"
            for name, chat in chats.items():
                chat.check_last(outs[name])
            # Idle past --session-offload-after: the session goes to the store; its next
            # turn restores it.
            chat = chats["intact"]
            wait_for(api.memory, lambda m: m["session_offloaded_tokens"] >= len(chat.history) - 1,
                     "the idle session's KV offloaded")
            before = len(chat.history)
            out = chat.turn()
            assert cached(out) == before - 1
            chat.check_last(out)
            for name in ["intact", "truncated", "corrupt"]:
                api.close(name)
                assert not files[name].exists()
            api.assert_accounted()
            history = chats["second"].history  # left open: written out at shutdown
    finally:
        second.check_clean_stop()

    # Another model on the same store: the KV it holds is refused, the history resumes.
    other_model = build_checkpoint(tmp_path / "other-model", "llama", seed=1)
    third = serve(other_model, store)
    try:
        with http_client(third) as http:
            api = SessionAPI(http)
            assert resume(api, "second").status_code == 200
            api.opened.append("second")
            assert api.memory()["session_offloaded_tokens"] == 0
            chat = StoredChat(api, rng, "second", history)
            out = chat.turn()
            assert cached(out) == 0
            chat.check_last(out)
    finally:
        third.check_clean_stop()


def _file_name(session_id: str) -> str:
    import hashlib

    return hashlib.sha256(session_id.encode()).hexdigest()[:40] + ".session"


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[:-7]))
    elif how == "payload":
        data[-2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        data[20] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("flags, words", [
    (["--session-store", "/tmp/x"], "needs enable_streaming_session"),
    (["--enable-streaming-session", "--session-store-max-gb", "0"], "must be positive"),
    (["--enable-streaming-session", "--session-offload-after", "-1"], "must be >= 0"),
])
def test_bad_store_flags_are_refused_before_anything_starts(flags, words):
    from radixserve.cli import build_parser, server_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-path", "m", *flags])
    with pytest.raises(ValueError, match=words):
        server_args_from_namespace(ns)
