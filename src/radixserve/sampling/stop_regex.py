"""``stop_regex`` matching whose cost is bounded, whatever pattern a user sends.

A stop regex is user input that runs on the scheduler's thread after every decode step. Python's
``re`` backtracks: ``(a|aa)+$b`` over a few dozen ``a`` takes exponential time, and a scheduler
stuck in one search stalls every other request until the watchdog ends the server
(docs/reliability.md). So patterns are compiled with RE2 (``google-re2``), whose search is
linear in the text, and refused with a ``ValueError`` naming ``stop_regex`` when RE2 cannot
compile them (backreferences, lookaround: the constructs that need backtracking) or when their
program is larger than ``_MAX_MEM``.

The text searched is bounded too, so that the per-step work does not grow with the output: only
the last ``window_tokens(patterns)`` generated tokens are decoded and searched. A match that new
text completes ends in that window; a pattern whose longest match is short gets a short window
(four tokens per character, +1 for a merge at the left edge, as for stop strings), and any other
pattern the last ``MAX_WINDOW_TOKENS`` tokens: a match longer than that is not looked for.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import re2

try:  # Python's regex parser, for a pattern's longest match (``sre_parse`` before 3.11)
    import re._parser as sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]

MAX_STOP_REGEX = 32  # patterns per request
MAX_STOP_REGEX_CHARS = 4096  # characters per pattern
# Tokens decoded and searched per request and step, at most (a match must lie in them).
MAX_WINDOW_TOKENS = 1024
# RE2's memory budget for one compiled pattern: a pattern needing more is refused.
_MAX_MEM = 8 << 20


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> re2._Regexp:
    """The compiled pattern; ``ValueError`` naming ``stop_regex`` when RE2 refuses it."""
    if not pattern:
        raise ValueError("stop_regex patterns must be non-empty")
    if len(pattern) > MAX_STOP_REGEX_CHARS:
        raise ValueError(f"stop_regex patterns may have at most {MAX_STOP_REGEX_CHARS} characters")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0] if e.args else "unsupported"
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        raise ValueError(
            f"stop_regex {pattern[:100]!r} is not supported: {reason} (stop_regex uses RE2 "
            "syntax: no backreferences or lookaround)"
        ) from None


def validate_stop_regex(patterns: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``stop_regex`` for too many or unsupported patterns."""
    if len(patterns) > MAX_STOP_REGEX:
        raise ValueError(f"at most {MAX_STOP_REGEX} stop_regex patterns are allowed")
    for pattern in patterns:
        compile_stop_regex(pattern)


@functools.lru_cache(maxsize=1024)
def _max_width(pattern: str) -> int | None:
    """Characters in the longest match of ``pattern``, None when unbounded or unknown (RE2
    syntax that Python's parser does not read)."""
    try:
        width = sre_parse.parse(pattern).getwidth()[1]
    except Exception:  # noqa: BLE001 - any parser failure means "unknown"
        return None
    return None if width >= MAX_WINDOW_TOKENS else width


def window_tokens(patterns: Sequence[str]) -> int:
    """Generated tokens whose text can hold a match that the newest token completes."""
    widths = [_max_width(p) for p in patterns]
    if any(w is None for w in widths):
        return MAX_WINDOW_TOKENS
    return min(4 * max(widths) + 1, MAX_WINDOW_TOKENS)  # type: ignore[type-var]


def find_stop_regex(patterns: Sequence[str], text: str, at_start: bool) -> str | None:
    """The first pattern with a match in ``text`` (the decoded window), or None.

    ``at_start``: the window begins at the output's first token. When it does not, its first
    character (perhaps half of a merged token) is context only: a search starts after it, so
    ``^`` and ``\\A`` do not match inside the output and ``\\b`` sees the character before.
    """
    pos = 0 if at_start or not text else 1
    for pattern in patterns:
        if compile_stop_regex(pattern).search(text, pos) is not None:
            return pattern
    return None


def match_start(pattern: str, text: str) -> int:
    """Where the first match of ``pattern`` in ``text`` begins, -1 when there is none (linear
    time: the detokenizer cuts the final text there)."""
    m = compile_stop_regex(pattern).search(text)
    return -1 if m is None else m.start()
