"""Grammar-constrained decoding: JSON schemas, regexes, EBNF and structural tags.

The scheduler asks ``GrammarCache.get(key)`` for a compiled grammar, gives each request a
``GrammarMatcher`` from ``cache.backend.new_matcher``, fills a token bitmask per step and lets
the sampler apply it (``base.py`` has the whole flow). Callers import from here only.
"""

from __future__ import annotations

from typing import Any

from radixserve.constrained.base import (
    GRAMMAR_KINDS,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarMatcher,
)
from radixserve.constrained.grammar_cache import GrammarCache

__all__ = [
    "GRAMMAR_KINDS",
    "GrammarBackend",
    "GrammarCache",
    "GrammarError",
    "GrammarKey",
    "GrammarMatcher",
    "create_grammar_backend",
]


def create_grammar_backend(
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: list[int],
    *,
    any_whitespace: bool = True,
    max_whitespace_cnt: int | None = None,
) -> GrammarBackend:
    """The xgrammar backend (imported here, on first use: xgrammar loads its native library).
    ``any_whitespace`` and ``max_whitespace_cnt`` are its ``JsonWhitespace``."""
    from radixserve.constrained.xgrammar_backend import JsonWhitespace, XGrammarBackend

    whitespace = JsonWhitespace(any_whitespace, max_whitespace_cnt)
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, whitespace)
