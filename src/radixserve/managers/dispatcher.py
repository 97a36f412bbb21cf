"""Route each incoming message to its handler by exact type."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class TypeBasedDispatcher:
    """``dispatcher(msg)`` calls the handler registered for ``type(msg)`` and returns its result.

    Exact types only (no ``isinstance`` walk), so a message can never match two handlers; an
    unknown type is a programming error between our own processes and raises.
    """

    def __init__(self, mapping: Iterable[tuple[type, Callable[[Any], Any]]]) -> None:
        self._handlers: dict[type, Callable[[Any], Any]] = {}
        for msg_type, handler in mapping:
            if msg_type in self._handlers:
                raise ValueError(f"two handlers for {msg_type.__name__}")
            self._handlers[msg_type] = handler

    def __call__(self, msg: Any) -> Any:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise TypeError(f"no handler for message type {type(msg).__name__}")
        return handler(msg)
