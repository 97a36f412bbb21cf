"""The grammar layer's contract: what a grammar library must provide to constrain decoding.

Data flow of a constrained request (``json_schema``, ``regex``, ``ebnf`` or ``structural_tag``
in its sampling parameters):

    GrammarKey(kind, spec)                       built by the scheduler from SamplingParams
      │  GrammarCache.get(key)                   compile once per key, on a worker thread
      ▼
    CompiledGrammar (backend-specific, immutable, shared by every request with that key)
      │  GrammarBackend.new_matcher(compiled)    one per request, when its grammar is ready
      ▼
    GrammarMatcher                               the request's position in the grammar:
        fill_bitmask(bitmask, row)   → which tokens may come next (before each sampling step)
        accept_token(token)          → advance on the token the sampler chose
        is_terminated()              → the grammar is complete and a stop token was accepted

Token masks are int32 bitmasks ``[batch, ceil(vocab / 32)]`` on the CPU (bit ``t % 32`` of word
``t // 32`` set = token ``t`` allowed; an all-ones row allows everything), applied to float
logits by ``GrammarBackend.apply_bitmask``, which sets forbidden tokens to ``-inf``.

There is no rollback: a matcher always holds exactly the request's ``output_ids``. Retraction
keeps a request's outputs (only its KV is recomputed), a request whose step is planned ahead
(overlap schedule) is never constrained, and a finished request's matcher is dropped with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarKey(NamedTuple):
    """What a request asks its output to match: a kind from ``GRAMMAR_KINDS`` and its text.

    Equal keys share one compilation (the compile cache is keyed by it).
    """

    kind: str
    spec: str


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why (the library's own words)."""


class GrammarMatcher(ABC):
    """One request's progress through its grammar. Used on the scheduler thread only."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``. Returns False, leaving the state unchanged, when the grammar
        does not allow it here (a token outside the last filled bitmask)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (the whole row is
        overwritten). Once the grammar is complete, only its stop tokens are allowed."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and the matcher accepted a stop token (the
        model's EOS): the request is done. Always False before any token was accepted."""


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary, and builds matchers over them.

    ``compile`` is called on a worker thread (it may take long and must not hold the GIL for
    that time); every other method is called on the scheduler thread.
    """

    vocab_size: int

    @abstractmethod
    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of ``key`` (opaque to callers, immutable, shareable), or
        ``GrammarError`` with a message for the user when the grammar is invalid or uses what
        the library would silently ignore."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of ``compiled`` (cheap: compile once, match many)."""

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """An all-allowed CPU bitmask for ``batch_size`` rows (int32, -1 everywhere)."""
        words = -(-self.vocab_size // 32)
        return torch.full((batch_size, words), -1, dtype=torch.int32)

    @staticmethod
    @abstractmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of forbidden tokens to ``-inf`` in place, in ``rows`` only.

        ``logits`` is float32 ``[batch, vocab_size]`` on any device; ``bitmask`` is on the
        CPU."""
