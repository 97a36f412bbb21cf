"""Stored responses (``store: true``), in the server's memory and bounded.

A stored response keeps what ``GET /v1/responses/{id}`` returns and what a request with
``previous_response_id`` continues: the conversation as chat messages (the response's own output
included, the request's ``instructions`` not, as OpenAI does), and the token ids and text of the
conversation as the model saw and wrote it, so that the next turn's prompt starts with exactly
those tokens and the radix cache serves their KV.

The store holds at most ``--responses-store-size`` responses, each for at most
``--responses-store-ttl`` seconds: the oldest goes when a new one would exceed the count, an
expired one when it is next looked at or a response is stored. Nothing survives a restart.

A response belongs to the caller that stored it (``managers/caller.py``: the API key or the
admin key it was sent with): another key can neither read, continue nor delete it, and is told
what it would be told of an id never stored.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.managers.caller import may_act_for
from radixserve.server.openai.protocol import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as the API returned it
    messages: list[ChatMessage]  # the conversation, this response's output included
    token_ids: array  # the conversation's tokens as the model saw and wrote them
    text: str  # the text those tokens decode to (the rendered prompt + the output text)
    stored_at: float
    owner: str | None = None  # the caller that stored it (managers/caller.py)


class ResponseStore:
    def __init__(self, max_size: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, body: dict[str, Any], messages: list[ChatMessage],
            token_ids: list[int], text: str, owner: str | None = None) -> None:
        self._expire()
        self._items[response_id] = StoredResponse(body, messages, array("i", token_ids), text,
                                                  self._clock(), owner)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str, caller: str | None = None) -> StoredResponse | None:
        """The stored response, None when there is none or ``caller`` may not see it: to any
        other caller a response is as absent as a deleted one."""
        self._expire()
        stored = self._items.get(response_id)
        if stored is None or not may_act_for(caller, stored.owner):
            return None
        return stored

    def delete(self, response_id: str, caller: str | None = None) -> bool:
        if self.get(response_id, caller) is None:
            return False
        del self._items[response_id]
        return True

    def _expire(self) -> None:
        """Drop the responses older than the ttl (the dict is in storing order)."""
        limit = self._clock() - self.ttl_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.stored_at > limit:
                break
            self._items.popitem(last=False)
