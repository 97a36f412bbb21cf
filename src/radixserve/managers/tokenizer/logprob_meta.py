"""Logprobs in SGLang's ``meta_info`` shape, accumulated from a request's output reports.

Every entry is ``[logprob, token_id, text]``, ``text`` being the token decoded alone with
``return_text_in_logprobs`` and ``null`` otherwise; a position without a value (the prompt's
first token has nothing before it) has ``logprob`` ``null``. The keys of a request with
``return_logprob``:

    input_token_logprobs, output_token_logprobs        one entry per position
    input_top_logprobs, output_top_logprobs            with top_logprobs_num: per position a list
                                                       of entries, most likely first (``null``
                                                       for the prompt's first token)
    input_token_ids_logprobs, output_token_ids_logprobs  with token_ids_logprob: per position a
                                                       list of entries, one per asked id
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.managers.io_struct import LogprobsOutput

Entry = list[Any]  # [logprob | None, token_id, text | None]


@dataclass
class LogprobMeta:
    """What one request asked for, and every entry received so far."""

    top_logprobs_num: int
    token_ids: list[int] | None
    decode: Callable[[list[int]], list[str]] | None  # ids → texts, with return_text_in_logprobs
    input_token: list[Entry] = field(default_factory=list)
    output_token: list[Entry] = field(default_factory=list)
    input_top: list[list[Entry] | None] = field(default_factory=list)
    output_top: list[list[Entry] | None] = field(default_factory=list)
    input_by_id: list[list[Entry] | None] = field(default_factory=list)
    output_by_id: list[list[Entry] | None] = field(default_factory=list)

    def add(self, out: LogprobsOutput, new_token_ids: list[int]) -> None:
        """Fold in one report (``new_token_ids``: its output tokens)."""
        self.output_token.extend(self._entries(out.output, new_token_ids))
        if out.output_top is not None:
            self.output_top.extend(self._top(tops) for tops in out.output_top)
        if out.output_token_ids is not None:
            self.output_by_id.extend(self._by_id(values) for values in out.output_token_ids)
        if out.input is not None:
            assert out.input_token_ids is not None
            self.input_token.extend(self._entries(out.input, out.input_token_ids))
            if out.input_top is not None:
                self.input_top.extend(self._top(tops) for tops in out.input_top)
            if out.input_token_ids_logprobs is not None:
                self.input_by_id.extend(self._by_id(v) for v in out.input_token_ids_logprobs)

    def to_meta(self) -> dict[str, Any]:
        """The ``meta_info`` keys (lists copied: cumulative stream chunks stay unchanged)."""
        meta: dict[str, Any] = {
            "input_token_logprobs": list(self.input_token),
            "output_token_logprobs": list(self.output_token),
        }
        if self.top_logprobs_num > 0:
            meta["input_top_logprobs"] = list(self.input_top)
            meta["output_top_logprobs"] = list(self.output_top)
        if self.token_ids:
            meta["input_token_ids_logprobs"] = list(self.input_by_id)
            meta["output_token_ids_logprobs"] = list(self.output_by_id)
        return meta

    def _entries(self, values: list[float | None], ids: list[int]) -> list[Entry]:
        if not ids:
            return []
        texts = self.decode(ids) if self.decode is not None else [None] * len(ids)
        return [[v, t, text] for v, t, text in zip(values, ids, texts, strict=True)]

    def _top(self, tops: list[tuple[int, float]] | None) -> list[Entry] | None:
        if tops is None:
            return None
        return self._entries([lp for _, lp in tops], [t for t, _ in tops])

    def _by_id(self, values: list[float] | None) -> list[Entry] | None:
        if values is None:
            return None
        assert self.token_ids is not None
        return self._entries(values, self.token_ids)
