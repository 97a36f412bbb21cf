"""What the TokenizerManager keeps for each request while it runs, and how a request's end
turns into the caller's outcome: its output so far (``ReqState``, in SGLang's output shape),
its timings for the metrics (``RequestMetrics``), and the errors a refused or failed request
raises (``raise_if_rejected``), which the HTTP edge maps to statuses (``server/errors.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from radixserve.finish_reason import FinishAbort, FinishReason
from radixserve.managers.tokenizer.logprob_meta import LogprobMeta


class ServiceUnavailableError(RuntimeError):
    """The engine cannot take requests now (its memory is released): HTTP 503."""


class CapacityError(RuntimeError):
    """A server-wide bound is reached (``--max-sessions``): HTTP 429, retry later."""


class SchedulerError(RuntimeError):
    """The scheduler failed while handling this request (a bug): HTTP 500 with the message.
    The scheduler and the other requests go on."""


@dataclass
class RequestMetrics:
    """Timings of one request (``time.perf_counter`` seconds), handed to the metrics callback."""

    rid: str
    arrival_time: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] | None = None  # per tier (hierarchical cache)
    completion_tokens: int = 0
    first_token_time: float | None = None
    # One entry per output message: (time it arrived, number of new tokens in it).
    token_times: list[tuple[float, int]] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: FinishReason | None = None


@dataclass(eq=False)
class ReqState:
    """Everything received so far for one rid; ``notify`` is shared by all rids of one call."""

    rid: str
    notify: asyncio.Event
    logprobs: LogprobMeta | None  # with return_logprob
    metrics: RequestMetrics
    log_metrics: bool = True
    session_id: str | None = None
    owner: str | None = None  # who sent it (managers/caller.py): only they may abort it
    priority: int | None = None  # the priority it named (docs/priority.md)
    evicted: bool = False  # evicted for a more important request (queue_eviction.py)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] | None = None
    finished_reason: FinishReason | None = None
    finished: bool = False
    dirty: bool = False  # received something the consumer has not yielded yet
    embedding: list[float] | None = None  # embedding requests only

    def to_dict(self) -> dict[str, Any]:
        """SGLang's output shape; lists are copied so cumulative chunks stay immutable."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self._finish_reason_dict(),
        }
        if self.cached_tokens_details is not None:
            meta["cached_tokens_details"] = dict(self.cached_tokens_details)
        if self.logprobs is not None:
            meta.update(self.logprobs.to_meta())
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def to_embedding_dict(self) -> dict[str, Any]:
        """SGLang's ``/encode`` output shape."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self._finish_reason_dict(),
        }
        return {"embedding": self.embedding, "meta_info": meta}

    def _finish_reason_dict(self) -> dict[str, Any] | None:
        reason = self.finished_reason
        return reason.to_dict() if reason is not None else None


_REJECTIONS: dict[int, type[Exception]] = {
    400: ValueError, 500: SchedulerError, 503: ServiceUnavailableError
}


def raise_if_rejected(states: list[ReqState], is_single: bool) -> None:
    """A request the scheduler refused or failed raises like our own checks do.

    The scheduler marks such an end with a ``status_code`` on its abort reason: 400 bad input
    (e.g. an invalid session: ``ValueError``), 500 its own failure, 503 memory released.
    """
    for i, state in enumerate(states):
        reason = state.finished_reason
        if isinstance(reason, FinishAbort) and reason.status_code in _REJECTIONS:
            error = _REJECTIONS[reason.status_code]
            raise error(reason.message if is_single else f"prompt {i}: {reason.message}")


def session_ids_of(obj: Any) -> set[str]:
    """The session ids a (not yet normalized) generate call names."""
    params = obj.session_params
    items = params if isinstance(params, list) else [params]
    return {p["id"] for p in items if isinstance(p, dict) and isinstance(p.get("id"), str)}


def session_id_of(req: Any) -> str | None:
    """The session id of one tokenized request, or None outside sessions."""
    params = getattr(req, "session_params", None)
    return params.id if params is not None else None
