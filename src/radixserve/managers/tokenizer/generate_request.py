"""The user-facing generate request, before tokenization.

A ``GenerateReqInput`` arrives from the ``Engine`` or the HTTP layer as either one prompt or a
batch of prompts (``text`` or ``input_ids``, never both). ``normalize()`` checks the shapes once
and fills in defaults so that the ``TokenizerManager`` only ever sees lists of equal length:

    single: text="hi", sampling_params={...}       → batch_size 1, is_single True
    batch:  text=["a", "b"], sampling_params={...}  → sampling_params broadcast to [{...}, {...}]
    n > 1:  text=["a", "b"], sampling_params={"n": 2}
                                                    → text ["a", "b", "a", "b"] (SGLang's order),
                                                      one generation each, a batch reply

Per-prompt fields (``rid``, ``sampling_params``, ``session_params``, ``lora_path`` and the
logprob options) take one value for every prompt or a list with one per prompt. Values inside
the sampling dicts are validated later by ``SamplingParams.from_dict``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

# A rid is the client's name for its request: echoed in replies, shown in logs and errors, and
# kept while the request runs. 1 to RID_MAX_LEN printable characters (no newline to forge a log
# line, no megabyte kept per request).
RID_MAX_LEN = 256


def _check_rid(rid: Any, name: str) -> None:
    if isinstance(rid, str) and 0 < len(rid) <= RID_MAX_LEN and rid.isprintable():
        return
    shown = repr(rid)
    if len(shown) > 40:
        shown = f"{shown[:40]}... ({len(rid)} characters)" if isinstance(rid, str) else shown[:40]
    raise ValueError(f"{name} must be a string of 1 to {RID_MAX_LEN} printable characters, "
                     f"got {shown}")


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
    return_logprob: bool | list[bool] | None = False
    # First prompt position whose logprob is returned (-1: none, only output logprobs).
    logprob_start_len: int | list[int] | None = -1
    top_logprobs_num: int | list[int] | None = 0
    # Token ids whose logprobs are returned at every position (one list, or one per prompt).
    token_ids_logprob: list[int] | list[list[int]] | None = None
    # Logprob entries carry the token's text: [logprob, id, text].
    return_text_in_logprobs: bool = False
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    # The LoRA adapter by name (None: the base model); one for all prompts, or one per prompt.
    lora_path: str | list[str | None] | None = None
    # False leaves the request out of metrics and request logs (health checks).
    log_metrics: bool = True
    # The data-parallel replica that runs every generation of the call (None: the policy's
    # choice); the TokenizerManager checks it against --dp-size.
    data_parallel_rank: int | None = None
    # The scheduling priority of every generation of the call (--enable-priority-scheduling;
    # docs/priority.md).
    priority: int | None = None

    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)
    # Prompts before expanding ``n`` (equal to batch_size when n is 1).
    num_prompts: int = field(default=1, init=False)

    def normalize(self) -> None:
        """Check shapes and fill defaults; raise ``ValueError`` naming what is wrong.

        After this, for a batch (or n > 1), every per-prompt field is a list of ``batch_size``;
        for a single request ``rid`` is a str, ``sampling_params`` a dict and the logprob
        options plain values.
        """
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text (prompt) and input_ids must be given")
        self._check_prompt_shape()
        if not isinstance(self.stream, bool) or not isinstance(self.return_text_in_logprobs, bool):
            raise ValueError("stream and return_text_in_logprobs must be booleans")
        rank = self.data_parallel_rank
        if rank is not None and (not _is_token_id(rank) or rank < 0):
            raise ValueError(f"data_parallel_rank must be a non-negative integer, got {rank!r}")
        n = self._parallel_samples()
        if self.is_single and n == 1:
            self._normalize_single()
            return
        self.num_prompts = self.batch_size
        self.is_single = False
        if n > 1:
            if self.text is not None:
                self.text = ([self.text] if isinstance(self.text, str) else self.text) * n
            else:
                rows = self.input_ids if not self._single_ids() else [self.input_ids]
                self.input_ids = rows * n
            self.batch_size *= n
        self._normalize_batch(n)

    # ------------------------------------------------------------------ shapes
    def _single_ids(self) -> bool:
        ids = self.input_ids
        return not (ids and all(isinstance(x, list) for x in ids))

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
            if self._single_ids():
                self.is_single, self.batch_size = True, 1
                rows = [ids]
            else:
                self.is_single, self.batch_size = False, len(ids)
                rows = ids
            if not all(_is_token_id(t) for row in rows for t in row):
                raise ValueError("input_ids must contain only integer token ids")
        if not self.is_single and self.batch_size == 0:
            raise ValueError("a batch request needs at least one prompt")

    def _parallel_samples(self) -> int:
        """``n`` of the sampling params (the same for every prompt); the params are replaced by
        copies without it (the caller's dicts are never changed)."""
        params = self.sampling_params
        dicts = params if isinstance(params, list) else [params]
        if not all(d is None or isinstance(d, dict) for d in dicts):
            raise ValueError("sampling_params must be a dict or a list of dicts")
        given = [1 if d.get("n") is None else d["n"] for d in dicts if d]
        for n in given:  # checked before the set: a list or dict value is unhashable
            if not _is_token_id(n) or n < 1:
                raise ValueError(f"n must be a positive integer, got {n!r}")
        stripped = [{k: v for k, v in d.items() if k != "n"} if d else {} for d in dicts]
        self.sampling_params = stripped if isinstance(params, list) else stripped[0]
        if len(set(given)) > 1:
            raise ValueError("n must be the same in the sampling params of every prompt")
        return given[0] if given else 1

    # ------------------------------------------------------------------ single
    def _normalize_single(self) -> None:
        if self.rid is None:
            self.rid = uuid.uuid4().hex
        else:
            _check_rid(self.rid, "rid")
        if not isinstance(self.sampling_params, dict):
            raise ValueError("sampling_params of a single request must be a dict")
        if self.session_params is not None and not isinstance(self.session_params, dict):
            raise ValueError("session_params of a single request must be a dict")
        if self.lora_path is not None and not isinstance(self.lora_path, str):
            raise ValueError("lora_path of a single request must be an adapter's name")
        self.return_logprob = self._check_bool(self.return_logprob, "return_logprob")
        self.logprob_start_len = self._check_start(self.logprob_start_len)
        self.top_logprobs_num = self._check_count(self.top_logprobs_num)
        self.token_ids_logprob = self._check_ids(self.token_ids_logprob)

    # ------------------------------------------------------------------ batch
    def _normalize_batch(self, n: int) -> None:
        self.rid = self._batch_rids(n)
        self.sampling_params = [
            dict(p) for p in self._per_prompt(self.sampling_params, "sampling_params", n)
        ]
        if self.session_params is not None:
            self.session_params = self._per_prompt(self.session_params, "session_params", n)
            if not all(p is None or isinstance(p, dict) for p in self.session_params):
                raise ValueError("every entry of session_params must be a dict")
        if self.lora_path is not None:
            self.lora_path = self._per_prompt(self.lora_path, "lora_path", n)
            if not all(p is None or isinstance(p, str) for p in self.lora_path):
                raise ValueError("every entry of lora_path must be an adapter's name or null")
        self.return_logprob = [
            self._check_bool(v, "return_logprob")
            for v in self._per_prompt(self.return_logprob, "return_logprob", n)
        ]
        self.logprob_start_len = [
            self._check_start(v)
            for v in self._per_prompt(self.logprob_start_len, "logprob_start_len", n)
        ]
        self.top_logprobs_num = [
            self._check_count(v)
            for v in self._per_prompt(self.top_logprobs_num, "top_logprobs_num", n)
        ]
        ids = self.token_ids_logprob
        per_prompt = isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids)
        self.token_ids_logprob = [
            self._check_ids(v)
            for v in (self._per_prompt(ids, "token_ids_logprob", n) if per_prompt
                      else [ids] * self.batch_size)
        ]

    def _batch_rids(self, n: int) -> list[str]:
        """One rid per generation: given per prompt (or a prefix for all), with ``_j`` for the
        j-th sample when n > 1."""
        prompts = self.num_prompts
        rid = self.rid
        if rid is None:
            return [uuid.uuid4().hex for _ in range(self.batch_size)]
        if isinstance(rid, str):
            _check_rid(rid, "rid")
            base = [f"{rid}_{i}" for i in range(prompts)] if prompts > 1 or n == 1 else [rid]
        elif isinstance(rid, list) and len(rid) == prompts:
            for i, r in enumerate(rid):
                _check_rid(r, f"rid[{i}]")
            base = list(rid)
        else:
            raise ValueError(
                f"rid must be a string or a list of {prompts} strings for {prompts} prompt(s)"
            )
        rids = base if n == 1 else [f"{base[k % prompts]}_{k // prompts}"
                                    for k in range(self.batch_size)]
        if len(set(rids)) != len(rids):
            raise ValueError("rids within one batch must be unique")
        return rids

    def _per_prompt(self, value: Any, name: str, n: int) -> list[Any]:
        """``value`` for each generation: a scalar (or dict) for all, or one per prompt."""
        if not isinstance(value, list):
            return [value] * self.batch_size
        if len(value) != self.num_prompts:
            raise ValueError(
                f"{name} must be a single value or a list of {self.num_prompts} for "
                f"{self.num_prompts} prompt(s)"
            )
        return list(value) * n

    # ------------------------------------------------------------------ values
    @staticmethod
    def _check_bool(value: Any, name: str) -> bool:
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean, got {value!r}")
        return value

    @staticmethod
    def _check_start(value: Any) -> int:
        if value is None:
            return -1
        if not _is_token_id(value) or value < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {value!r}")
        return value

    @staticmethod
    def _check_count(value: Any) -> int:
        if value is None:
            return 0
        if not _is_token_id(value) or value < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {value!r}")
        return value

    @staticmethod
    def _check_ids(value: Any) -> list[int] | None:
        if not value:
            return None
        if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
            raise ValueError("token_ids_logprob must be a list of token ids (or one per prompt)")
        return list(value)

    def __getitem__(self, i: int) -> GenerateReqInput:
        """The i-th generation of a normalized request, as a single request."""
        if self.is_single:
            assert i == 0
            return self
        sub = GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            stream=self.stream,
            return_logprob=self.return_logprob[i],
            logprob_start_len=self.logprob_start_len[i],
            top_logprobs_num=self.top_logprobs_num[i],
            token_ids_logprob=self.token_ids_logprob[i],
            return_text_in_logprobs=self.return_text_in_logprobs,
            session_params=self.session_params[i] if self.session_params else None,
            lora_path=self.lora_path[i] if self.lora_path else None,
            log_metrics=self.log_metrics,
            data_parallel_rank=self.data_parallel_rank,
            priority=self.priority,
        )
        sub.normalize()
        return sub
