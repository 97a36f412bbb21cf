"""Regexes that would make xgrammar's matcher slow down without bound, refused before compiling.

xgrammar expands a bounded repetition ``x{m,n}`` into copies of ``x``. When ``x`` can match the
empty string (``([a-z]{0,30}){0,29}``), the copies can split the same text in very many ways, and
the matcher keeps every split alive: each accepted token costs more than the one before. Measured
with xgrammar 0.2.x on a 2-core guest: ``(([a-z]{0,10}){0,10}){0,10}`` took 72 ms for its 40th
token, ``(([a-z]{0,30}){0,29}){0,31}`` a second for its tenth (on the scheduler's thread, so every
other request waited) and one more level of bound kept the compile thread busy for over eight
minutes; the same patterns with a non-empty part (``x{1,n}``) stay under 5 ms a token. Such a
repetition is refused with a 400 that says how to write it instead, once its copies (those of the
repetitions around it that can be empty too, multiplied) number more than ``MAX_EMPTY_COPIES``:
``(x|){3}`` is harmless. Unbounded ``*`` and ``+`` of a part that can be empty are fine (xgrammar
loops them rather than copying).

The pattern is read with Python's own regex parser (``re._parser``), whose syntax covers what
xgrammar's regexes use; a pattern it cannot parse is left to xgrammar, which reports its own
syntax errors.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from re import _constants as _sre_constants
from re import _parser as _sre_parse
from typing import Any

from radixserve.constrained.base import GrammarError

_REPEATS = tuple(
    getattr(_sre_constants, name)
    for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
    if hasattr(_sre_constants, name)
)
_UNBOUNDED = _sre_constants.MAXREPEAT
MAX_EMPTY_COPIES = 8


def check_regex(pattern: str, where: str) -> None:
    """Raise ``GrammarError`` (its message starting with ``where``) if ``pattern`` repeats a
    part that can match the empty string a bounded number of times (see the module docstring)."""
    try:
        with warnings.catch_warnings():  # "possible nested set" and such: xgrammar's to judge
            warnings.simplefilter("ignore")
            parsed = _sre_parse.parse(pattern)
    except Exception:  # not Python's syntax (or too deep for its parser): xgrammar judges it
        return
    for low, high in _copied_empty_parts(parsed, 1):
        bounds = f"{{{low},{'' if high == _UNBOUNDED else high}}}"
        raise GrammarError(
            f"{where}: the repetition {bounds} repeats a part that can match the empty "
            f"string (more than {MAX_EMPTY_COPIES} copies, with the repetitions around it), "
            "which makes constrained decoding slow down with every token (each way of "
            "splitting the text stays alive); make the repeated part non-empty (x{1,n} rather "
            "than x{0,n}) or write the bounds as one repetition"
        )


def _copied_empty_parts(sub: Any, outer: int) -> Iterator[tuple[int, int]]:
    """``(min, max)`` of each repetition in ``sub`` whose repeated part can match the empty
    string and whose copies (its finite max, else its min), times ``outer`` (those of the
    enclosing such repetitions), exceed ``MAX_EMPTY_COPIES``."""
    for op, arg in sub:
        inner = outer
        if op in _REPEATS:
            low, high, body = arg
            if body.getwidth()[0] == 0:
                inner = outer * (low if high == _UNBOUNDED else high)
                if inner > MAX_EMPTY_COPIES:
                    yield low, high
        for child in _subpatterns(arg):
            yield from _copied_empty_parts(child, inner)


def _subpatterns(arg: Any) -> Iterator[Any]:
    if isinstance(arg, _sre_parse.SubPattern):
        yield arg
    elif isinstance(arg, (tuple, list)):
        for item in arg:
            yield from _subpatterns(item)
