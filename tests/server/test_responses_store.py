"""``ResponseStore``: bounded by count (oldest first) and by age, on a clock the test moves."""

from __future__ import annotations

import pytest

from radixserve.server.openai.protocol import ChatMessage
from radixserve.server.openai.responses_store import ResponseStore
from radixserve.server_args import ServerArgs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, name: str) -> None:
    store.put(name, {"id": name}, [ChatMessage(role="user", content=name)], [1, 2, 3], name)


def test_the_oldest_goes_past_the_count():
    store = ResponseStore(max_size=2, ttl_s=60, clock=Clock())
    for name in ("a", "b", "c"):
        put(store, name)
    assert store.get("a") is None and len(store) == 2
    assert store.get("b").body == {"id": "b"} and list(store.get("c").token_ids) == [1, 2, 3]


def test_responses_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_size=10, ttl_s=60, clock=clock)
    put(store, "a")
    clock.now += 30
    put(store, "b")
    clock.now += 30  # "a" is 60 s old
    assert store.get("a") is None and store.get("b") is not None
    clock.now += 30
    assert store.get("b") is None and len(store) == 0


def test_delete_says_whether_it_held_the_response():
    store = ResponseStore(max_size=10, ttl_s=60, clock=Clock())
    put(store, "a")
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


@pytest.mark.parametrize("field", ["responses_store_size", "responses_store_ttl"])
def test_bounds_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(model_path="m", **{field: 0})
