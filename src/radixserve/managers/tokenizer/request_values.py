"""The values a request may carry, checked before anything else reads them.

JSON lets a client write numbers and strings that no part of the server can carry:

- integers past 64 bits: msgpack (our IPC codec) and torch hold at most 64 bits, so such a value
  would fail while the request is sent to the scheduler;
- NaN and infinities (Python's ``json`` reads ``NaN``, ``Infinity``): every range check on
  them is false, so they would slip past validation;
- lone UTF-16 surrogates (``"\\ud800"``): not Unicode text, so tokenizers and UTF-8 encoders
  refuse them;
- nesting deeper than ``MAX_DEPTH``: nothing the API defines is that deep, and recursive code
  (schema compilers, serializers) would run out of stack on it.

``find_unrepresentable`` names the first such value by its path in the request (``"seed"``,
``"sampling_params.sampling_seed"``, ``"messages.0.content"``): the HTTP layer answers 400 with
that name for the whole body before any route runs, and the ``TokenizerManager`` checks every
message it sends the same way (for ``Engine`` callers, who bypass HTTP).
"""

from __future__ import annotations

import math
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_DEPTH = 64


def find_unrepresentable(value: Any) -> tuple[str, str] | None:
    """The first value of a JSON-like tree (dicts, lists, scalars) the server cannot carry, as
    ``(path, why)``; None when every value is fine. Iterative: any depth is safe to check."""
    if not isinstance(value, (dict, list)):
        found = _bad_scalar(value)
        return None if found is None else ("", found)
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        container, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            return _dotted(path[:1]), f"the request is nested more than {MAX_DEPTH} levels deep"
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in items:
            if isinstance(key, str) and (why := _bad_text(key)) is not None:
                return _dotted(path), f"a key {why}"
            if isinstance(item, (dict, list)):
                stack.append((item, (*path, key)))
            elif (why := _bad_scalar(item)) is not None:
                return _dotted((*path, key)), why
    return None


def describe(path: str, why: str) -> str:
    """The message of a 400 for ``find_unrepresentable``'s result."""
    return f"{path}: {why}" if path else why


def _bad_scalar(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return None
        return f"the integer {_short(value)} does not fit in 64 bits (-2**63 to 2**63 - 1)"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, str):
        return _bad_text(value)
    return None


def _bad_text(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character "
            f"{e.start}), which is not Unicode text"
        )
    return None


def _short(value: int) -> str:
    digits = str(value) if value.bit_length() < 4000 else None
    if digits is not None and len(digits) <= 40:
        return digits
    return f"of about {int(value.bit_length() * math.log10(2)) + 1} digits"


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)
