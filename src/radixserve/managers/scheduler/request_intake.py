"""The scheduler's intake of new requests: a generate or embedding request is judged and queued,
or finished at once (an ``abort`` finish reason with its status code) with the reason it
cannot run (docs/architecture.md §4, Requests).

A session request's prompt is assembled by the ``SessionController`` (§5), and it is judged
after what it depends on has ended: a running request it replaces (aborted here), or its
streaming session's turn whose abort arrived just before it (deferred until the scheduler
finished the aborted requests: ``run_deferred``). The checks are ``request_validation.py``'s.

``RequestIntake`` reaches the scheduler only through ``IntakeScheduler`` below (this module never
imports the scheduler).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from radixserve.finish_reason import FinishAbort
from radixserve.managers.io_struct import (
    AbortReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.scheduler.grammar_queue import GrammarQueue
from radixserve.managers.scheduler.lora_requests import bind_lora
from radixserve.managers.scheduler.request_validation import embedding_error, generate_error
from radixserve.managers.scheduler.schedule_batch import Req
from radixserve.managers.scheduler.scheduler_control import SchedulerControl
from radixserve.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.managers.scheduler.scheduler_parts import SchedulerParts, SchedulerSettings

# The scheduler's log, where refusals have always been logged.
logger = logging.getLogger("radixserve.managers.scheduler.scheduler")


class IntakeScheduler(Protocol):
    """What the intake reaches of the ``Scheduler``."""

    waiting_queue: list[Req]  # accepted requests are appended
    settings: SchedulerSettings  # the prefill budget an encoder's input must fit

    def holding_reqs(self) -> list[Req]: ...
    def handle_abort(self, msg: AbortReq) -> None: ...


class RequestIntake:
    def __init__(
        self,
        scheduler: IntakeScheduler,
        parts: SchedulerParts,
        grammar_queue: GrammarQueue,
        control: SchedulerControl,
    ) -> None:
        """``parts``: the scheduler's (the model's kind, the limits, sessions, the output path);
        ``control``: whether memory is released (new requests then get 503)."""
        self.scheduler = scheduler
        self.is_generation, self.limits = parts.is_generation, parts.limits
        self.sessions, self.output_processor = parts.sessions, parts.output_processor
        self.grammar_queue, self.control = grammar_queue, control
        self.lora = parts.tp_worker.model_runner.lora  # None without --enable-lora
        self.priority = parts.priority  # None without --enable-priority-scheduling
        # Generate and embedding requests received (the load reports count them).
        self.num_received_reqs = 0
        # Session turns that arrived while their session's turn in flight was being aborted:
        # judged once the abort took effect (``run_deferred``), so that they find it gone.
        self._after_aborts: list[TokenizedGenerateReqInput] = []

    def run_deferred(self) -> None:
        """Judge the session turns deferred behind an abort (the scheduler has just finished
        the aborted requests)."""
        deferred, self._after_aborts = self._after_aborts, []
        for msg in deferred:
            self.handle_generate_request(msg)

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Judge a generate request and queue it (the grammar queue for a constrained one),
        or finish it at once with the reason it cannot run."""
        self.num_received_reqs += 1
        turn = None
        if not self.is_generation or self.control.released:
            req = Req(msg.rid, list(msg.input_ids), msg.sampling_params)
            if self.control.released:
                self._reject(req, self.control.released_message(), status_code=503)
            else:
                self._reject(
                    req, "this server serves an embedding model: use /encode or /v1/embeddings"
                )
            return
        if msg.session_params is not None:
            # A request of a session is judged after what it depends on has ended: a replaced
            # running request (aborted here), or its streaming session's turn whose abort
            # (a client that went away) arrived just before it.
            replaced = self.sessions.running_rid_to_replace(msg)
            if replaced is not None:
                self.scheduler.handle_abort(AbortReq(rid=replaced))
            if self._aborting(replaced or self.sessions.inflight_rid(msg)):
                self._after_aborts.append(msg)
                return
        if msg.session_params is not None:
            turn = self.sessions.plan(msg)
            req, error = Req.from_message(msg, turn.input_ids), turn.error
            req.streaming_session_id = turn.streaming_session_id
        else:
            req, error = Req.from_message(msg, list(msg.input_ids)), None
        error = error or generate_error(req.origin_input_ids, msg, self.limits)
        error = error or bind_lora(req, msg.lora_path, self.lora)
        if self.priority is not None:
            self.priority.assign(req, msg.priority)
        elif msg.priority is not None:
            error = error or "priority needs a server started with --enable-priority-scheduling"
        if error is not None:
            self._reject(req, error)
            return
        if turn is not None:
            for replaced in self.sessions.admit(turn, req):
                self.scheduler.handle_abort(AbortReq(rid=replaced.rid))
        if msg.sampling_params.grammar is not None:
            self.grammar_queue.add(req)
        else:
            self.scheduler.waiting_queue.append(req)

    def handle_embedding_request(self, msg: TokenizedEmbeddingReqInput) -> None:
        """Queue an embedding: a prefill that samples nothing (``max_new_tokens`` 0)."""
        self.num_received_reqs += 1
        req = Req(msg.rid, list(msg.input_ids), SamplingParams(max_new_tokens=0))
        req.token_type_ids = msg.token_type_ids
        if self.control.released:
            self._reject(req, self.control.released_message(), status_code=503)
            return
        if self.is_generation:
            error = "this server serves a generation model: start it with --is-embedding"
        else:
            settings = self.scheduler.settings
            budget = min(settings.max_prefill_tokens, settings.chunked_prefill_size)
            error = embedding_error(req.origin_input_ids, self.limits, budget)
        if error is not None:
            self._reject(req, error)
            return
        self.scheduler.waiting_queue.append(req)

    def _reject(self, req: Req, error: str, status_code: int = 400) -> None:
        logger.info("request %r rejected: %s", req.rid, error)
        # status_code 400: bad input, raised to the caller as a ValueError; 503: unavailable.
        reason = FinishAbort(message=error, status_code=status_code)
        self.output_processor.finish_now([req], reason)

    def _aborting(self, rid: str | None) -> bool:
        """Whether ``rid`` is a request an abort has marked, which ends at the next step."""
        if rid is None:
            return False
        return any(r.rid == rid and r.to_abort is not None for r in self.scheduler.holding_reqs())
