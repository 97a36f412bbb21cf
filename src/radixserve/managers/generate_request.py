"""The user-facing generate request, before tokenization.

A ``GenerateReqInput`` arrives from the ``Engine`` or the HTTP layer as either one prompt or a
batch of prompts (``text`` or ``input_ids``, never both). ``normalize()`` checks the shapes once
and fills in defaults so that the ``TokenizerManager`` only ever sees lists of equal length:

    single: text="hi", sampling_params={...}      → batch_size 1, is_single True
    batch:  text=["a", "b"], sampling_params={...} → sampling_params broadcast to [{...}, {...}]

Values inside the sampling dicts are validated later by ``SamplingParams.from_dict``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def _is_token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class GenerateReqInput:
    """One generate call (single or batch); call ``normalize()`` before reading the lists."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None

    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)

    def normalize(self) -> None:
        """Check shapes and fill defaults; raise ``ValueError`` naming what is wrong.

        After this, for a batch, ``rid``, ``sampling_params`` and ``session_params`` are lists of
        ``batch_size``; for a single request they are a str, a dict and a dict or None.
        """
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text (prompt) and input_ids must be given")
        self._check_prompt_shape()
        if not isinstance(self.stream, bool) or not isinstance(self.return_logprob, bool):
            raise ValueError("stream and return_logprob must be booleans")
        if not _is_token_id(self.top_logprobs_num) or self.top_logprobs_num < 0:
            raise ValueError(
                f"top_logprobs_num must be a non-negative integer, got {self.top_logprobs_num!r}"
            )
        if self.is_single:
            self._normalize_single()
        else:
            self._normalize_batch()

    def _check_prompt_shape(self) -> None:
        if self.text is not None:
            if isinstance(self.text, str):
                self.is_single, self.batch_size = True, 1
            elif isinstance(self.text, list) and all(isinstance(t, str) for t in self.text):
                self.is_single, self.batch_size = False, len(self.text)
            else:
                raise ValueError("text must be a string or a list of strings")
        else:
            ids = self.input_ids
            if not isinstance(ids, list):
                raise ValueError("input_ids must be a list of token ids or a list of such lists")
            if ids and all(isinstance(x, list) for x in ids):
                self.is_single, self.batch_size = False, len(ids)
                rows = ids
            else:
                self.is_single, self.batch_size = True, 1
                rows = [ids]
            if not all(_is_token_id(t) for row in rows for t in row):
                raise ValueError("input_ids must contain only integer token ids")
        if not self.is_single and self.batch_size == 0:
            raise ValueError("a batch request needs at least one prompt")

    def _normalize_single(self) -> None:
        if self.rid is None:
            self.rid = uuid.uuid4().hex
        elif not isinstance(self.rid, str) or not self.rid:
            raise ValueError("rid of a single request must be a non-empty string")
        if self.sampling_params is None:
            self.sampling_params = {}
        elif not isinstance(self.sampling_params, dict):
            raise ValueError("sampling_params of a single request must be a dict")
        if self.session_params is not None and not isinstance(self.session_params, dict):
            raise ValueError("session_params of a single request must be a dict")

    def _normalize_batch(self) -> None:
        n = self.batch_size
        if self.rid is None:
            self.rid = [uuid.uuid4().hex for _ in range(n)]
        elif not isinstance(self.rid, list) or len(self.rid) != n:
            raise ValueError(f"rid must be a list of {n} strings for a batch of {n} prompts")
        elif not all(isinstance(r, str) and r for r in self.rid):
            raise ValueError("every rid must be a non-empty string")
        elif len(set(self.rid)) != n:
            raise ValueError("rids within one batch must be unique")
        self.sampling_params = self._broadcast(self.sampling_params or {}, "sampling_params")
        if self.session_params is not None:
            self.session_params = self._broadcast(self.session_params, "session_params")

    def _broadcast(self, value: dict | list, name: str) -> list:
        n = self.batch_size
        if isinstance(value, dict):
            return [dict(value) for _ in range(n)]
        if isinstance(value, list) and len(value) == n:
            if not all(v is None or isinstance(v, dict) for v in value):
                raise ValueError(f"every entry of {name} must be a dict")
            return [dict(v) if v else {} for v in value] if name == "sampling_params" else value
        raise ValueError(f"{name} must be a dict or a list of {n} dicts for a batch of {n}")

    def __getitem__(self, i: int) -> GenerateReqInput:
        """The i-th prompt of a normalized request, as a single request."""
        if self.is_single:
            assert i == 0
            return self
        sub = GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            stream=self.stream,
            return_logprob=self.return_logprob,
            top_logprobs_num=self.top_logprobs_num,
            session_params=self.session_params[i] if self.session_params else None,
        )
        sub.normalize()
        return sub
