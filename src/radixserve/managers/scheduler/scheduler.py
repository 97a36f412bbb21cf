"""The scheduler's state and the handlers of incoming messages (docs/architecture.md §4).

The ``Scheduler`` owns the waiting queue, the running batch (one per pipeline micro-batch,
``micro_batches.py``) and the chunked request. A loop drives it (``scheduler_loop.py``: normal,
overlap or pipeline, chosen by ``build_scheduler``) through the methods of its "loop's surface":
a step admits compiled grammars, takes ``get_next_batch_to_run`` (a new prefill if one fits,
``prefill_planner.py``, else a decode step), runs it and processes its result
(``output_processor.py``). Messages are dispatched by type (``process_input_requests``): new
requests (``request_intake.py``, checked by ``request_validation.py``), aborts, sessions, and
the control requests of ``scheduler_control.py`` (flush, pause, weights, memory, ...).

Parallel ranks: every rank of a replica runs this scheduler on the same messages
(``RequestReceiver``) and so takes the same decisions; only rank 0 sends outputs and replies.
Grammars compile on each rank, and a step waits until all queued ones are compiled, so that all
ranks admit them at the same step.

The parts it composes are built by ``build_scheduler`` (``scheduler_builder.py``): the model
(``TpModelWorker``), the prefix cache (``mem_cache``), ``PrefillPlanner`` (admission),
``retract_for_decode`` (memory pressure), ``OutputProcessor`` (results), ``GrammarQueue``
(constrained requests until their grammar is compiled) and the ``SessionController``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from radixserve import envs
from radixserve.distributed import ParallelState
from radixserve.finish_reason import FinishAbort
from radixserve.layers.sampler import SampleOutput
from radixserve.managers.dispatcher import TypeBasedDispatcher
from radixserve.managers.io_struct import (
    AbortReq,
    CloseSessionReqInput,
    ControlErrorOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadReport,
    OpenSessionReqInput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.scheduler.grammar_queue import GrammarQueue
from radixserve.managers.scheduler.lora_requests import LoRAControl
from radixserve.managers.scheduler.memory_check import MemoryChecker, busy_check_enabled
from radixserve.managers.scheduler.micro_batches import MicroBatches
from radixserve.managers.scheduler.priority_scheduling import WAITING_TIMEOUT_MESSAGE, timed_out
from radixserve.managers.scheduler.request_intake import RequestIntake
from radixserve.managers.scheduler.retraction import (
    retract_all,
    retract_for_decode,
)
from radixserve.managers.scheduler.schedule_batch import (
    Req,
    ScheduleBatch,
    num_live_reqs,
)
from radixserve.managers.scheduler.scheduler_control import SchedulerControl
from radixserve.managers.scheduler.scheduler_loop import LoopScheduler, SchedulerLoop
from radixserve.managers.scheduler.scheduler_stats import LoadReporter, SchedulerStats
from radixserve.managers.scheduler.weight_sync_control import WeightSyncControl
from radixserve.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.managers.scheduler.request_receiver import RequestReceiver
    from radixserve.managers.scheduler.scheduler_parts import SchedulerParts, SchedulerSettings

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar to compile (messages wait meanwhile).
_GRAMMAR_WAIT_S = 0.01


class Scheduler:
    """Owns the waiting queue, the running batch and the chunked request; runs one step at a time.

    Outputs leave through the two callables (the process wires them to ZMQ sockets; tests pass
    ``list.append``).
    """

    def __init__(
        self,
        parts: SchedulerParts,
        settings: SchedulerSettings,
        send_to_tokenizer: Callable[[Any], None],
        parallel: ParallelState,
        make_loop: Callable[[LoopScheduler], SchedulerLoop],
        dp_rank: int = 0,
        send_load: Callable[[LoadReport], None] | None = None,
    ) -> None:
        """Built by ``build_scheduler`` (``scheduler_builder.py``), which reads the server's
        arguments and makes ``parts``. ``make_loop``: the loop that drives this scheduler
        (normal, overlap or pipeline; ``scheduler_loop.py``), made once here. ``dp_rank``: the
        data-parallel replica this rank belongs to; ``send_load``: where changes of its load go
        (the data-parallel controller)."""
        self.settings = settings
        self.send_to_tokenizer = send_to_tokenizer
        self.load_reporter = None if send_load is None else LoadReporter(dp_rank, send_load)
        self.parallel = parallel
        self.dp_rank = dp_rank
        self.model_config = parts.model_config
        self.is_generation = parts.is_generation
        self.tp_worker = parts.tp_worker
        runner = self.tp_worker.model_runner
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.max_total_num_tokens: int = runner.max_total_num_tokens
        self.max_running_requests: int = runner.max_running_requests
        self.page_size: int = runner.page_size
        self.tree_cache = parts.tree_cache
        self.grammars = parts.grammars
        self.grammar_queue = GrammarQueue(self.grammars, settings.grammar_timeout)
        self.sessions = parts.sessions
        self.memory = MemoryChecker(
            self.tree_cache, self.allocator, self.req_to_token_pool, self.max_total_num_tokens
        )
        self.check_busy = busy_check_enabled()
        self.batch_resources = parts.batch_resources
        self.new_token_ratio = parts.new_token_ratio
        self.prefill_planner = parts.prefill_planner
        self.output_processor = parts.output_processor

        self.waiting_queue: list[Req] = []
        self.micro_batches = MicroBatches(
            self.parallel.info.pp_size, lambda: ScheduleBatch([], self.batch_resources)
        )
        self.chunked_req: Req | None = None  # holds KV between its prefill chunks
        self.num_retracted_reqs = 0
        self.priority = parts.priority  # None without --enable-priority-scheduling
        self.num_preempted_reqs = 0  # running requests retracted for a more important one
        self.num_aborted_reqs = 0  # running or waiting requests ended by an abort
        self.last_leak_check: dict[str, Any] = {}
        self.stop_requested = False
        # where this rank's messages come from; a slowed-down step sleeps on it
        # (SchedulerControl._sleep); set by the process before its loop runs
        self.receiver: RequestReceiver | None = None
        self.idle_checked = False  # the idle self-check ran since the last step
        self.paused = False  # by PauseGenerationReqInput: no step runs until continued
        self.stats = SchedulerStats()
        self.control = SchedulerControl(self)
        self.intake = RequestIntake(self, parts, self.grammar_queue, self.control)
        self._step_start = time.perf_counter()
        self._inject_faults = envs.RADIXSERVE_TEST_INJECT_FAULTS.get()
        self.loop = make_loop(self)

        self.dispatcher = TypeBasedDispatcher(
            [
                (TokenizedGenerateReqInput, self.intake.handle_generate_request),
                (TokenizedEmbeddingReqInput, self.intake.handle_embedding_request),
                (AbortReq, self.handle_abort),
                (GetInternalStateReq, self.handle_get_internal_state),
                (OpenSessionReqInput, self.sessions.open),
                (CloseSessionReqInput, lambda msg: self.sessions.close(msg.session_id)),
                *self.control.handlers(),
                *LoRAControl(self.tp_worker.model_runner.lora).handlers(),
                *WeightSyncControl(self).handlers(),
            ]
        )

    def ready_info(self) -> dict[str, Any]:
        return {
            "status": "ready",
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "context_len": self.model_config.context_len,
            "page_size": self.page_size,
        }

    @property
    def running_batch(self) -> ScheduleBatch:
        """The running batch of the current micro-batch (the only one without pipelining)."""
        return self.micro_batches.current.running

    # ------------------------------------------------------------------ the loop's surface
    # What the loops (``scheduler_loop.py``: ``LoopScheduler``) call; nothing else of this
    # class is theirs to read or write.
    def step(self) -> bool:
        """One step of this scheduler's loop; False when there was nothing to run or
        generation is paused (tests drive the scheduler with it)."""
        return self.loop.run_step()

    @property
    def overlap(self) -> SchedulerLoop | None:
        """The loop when it is the overlap loop (it has a step in flight between steps)."""
        return self.loop if self.loop.launches_ahead else None

    def report_load(self) -> None:
        """Tell the data-parallel controller this replica's load, when it changed."""
        if self.load_reporter is not None:
            self.load_reporter.report(
                self.num_running(), self.num_waiting(), self.memory_state(),
                self.intake.num_received_reqs,
            )

    def process_input_requests(self, msgs: list[Any]) -> None:
        """Dispatch each message; one that raises fails alone (its request gets a 500, a
        control caller its error) and the loop goes on with the rest."""
        for msg in msgs:
            try:
                if self._inject_faults and getattr(msg, "rid", "").startswith("inject-fault-"):
                    raise RuntimeError(f"injected fault while handling {msg.rid}")
                reply = self.dispatcher(msg)
            except Exception as e:
                logger.exception("failed to handle %s", type(msg).__name__)
                reply = self._failure_reply(msg, e)
            if reply is not None:
                self.send_to_tokenizer(reply)

    def _failure_reply(self, msg: Any, error: Exception) -> ControlErrorOutput | None:
        message = f"internal error in the scheduler: {type(error).__name__}: {error}"
        if isinstance(msg, (TokenizedGenerateReqInput, TokenizedEmbeddingReqInput)):
            req = Req(msg.rid, [], SamplingParams(max_new_tokens=0))
            reason = FinishAbort(message=message, status_code=500)
            self.output_processor.finish_now([req], reason)
            return None
        return ControlErrorOutput(request=type(msg).__name__, message=message)

    def skip_step_paused(self) -> bool:
        """True while generation is paused: no step runs (sessions' housekeeping still does)."""
        if self.paused:
            self.sessions.on_step()
        return self.paused

    def begin_step(self) -> None:
        """A step starts: sessions' housekeeping, compiled grammars join the waiting queue, and
        the step's duration starts (it goes to the step statistics)."""
        self.sessions.on_step()
        self._admit_compiled_grammars()
        self._step_start = time.perf_counter()

    def run_batch(self, batch: ScheduleBatch) -> SampleOutput | torch.Tensor | None:
        """The model step of ``batch``: its tokens (an embedding model: its embeddings), or
        None on a pipeline stage that does not sample (the tokens come round the pipeline)."""
        self.note_launch()
        forward_batch = batch.to_forward_batch()
        if self.is_generation:
            result = self.tp_worker.forward_batch_generation(forward_batch)
        else:
            result = self.tp_worker.forward_batch_embedding(forward_batch)
        self.model_step_done()
        return result

    def note_launch(self) -> None:
        """A model step is launched: the next idle period runs the idle self-check again."""
        self.idle_checked = False

    def model_step_done(self) -> None:
        """After every model step: the profiler counts it, ``slow_down`` sleeps."""
        self.control.after_step()

    def admission_pending(self) -> bool:
        """Whether the next step may admit a request, so that it cannot be planned before the
        tokens of the step in flight are known (overlap loop): a chunked request continues, or
        a waiting request may find a request row (one is free below ``max_running_requests``,
        or an idle streaming session's row could be released), or may preempt a running one,
        or has waited past its timeout (``priority_scheduling.py``)."""
        if self.chunked_req is not None:
            return True
        if self.waiting_queue and (self._preemption_victim() is not None or self._late()):
            return True  # a preemption, or a waiting timeout, to act on now
        if not self.waiting_queue or len(self.running_batch) >= self.max_running_requests:
            return False
        return (
            self.req_to_token_pool.available_size() > 0
            or self.tree_cache.session_held_rows() > 0
        )

    def prepare_decode_behind(self, previous: ScheduleBatch) -> None:
        """Plan the running batch's next decode step while ``previous`` (its last step, still
        computing) has not returned its tokens (overlap loop)."""
        self.new_token_ratio.step()
        self.running_batch.prepare_for_decode(behind=previous)

    def persist_sessions(self) -> None:
        """The loop ends on a stop: streaming sessions go to the session store."""
        self.sessions.persist_all()

    def on_idle(self) -> bool:
        """Nothing to run: wait a moment for a compiling grammar (True: not idle), else run
        the idle self-check once (False: idle)."""
        if self.grammar_queue:
            self.grammar_queue.wait(_GRAMMAR_WAIT_S)
            return True
        if not self.idle_checked:
            self.self_check_during_idle()
            self.idle_checked = True
        return False

    def _admit_compiled_grammars(self) -> None:
        """Constrained requests whose grammar is ready join the waiting queue; those whose
        grammar failed to compile finish with its error (status 400)."""
        if not self.grammar_queue:
            return
        compiled = self.grammar_queue.pop_compiled(wait_all=self.parallel.distributed)
        self.waiting_queue.extend(compiled.ready)
        for req, reason in compiled.failed:
            logger.info("request %r rejected: %s", req.rid, reason.message)
            self.output_processor.finish_now([req], reason)

    def process_batch_result(
        self, batch: ScheduleBatch, result: SampleOutput | torch.Tensor
    ) -> None:
        """Apply a step's tokens (embeddings) to its requests; the batch's survivors join (or
        stay in) the running batch."""
        running = len(self.running_batch) if batch.forward_mode.is_extend else len(batch)
        self.stats.record(
            batch, time.perf_counter() - self._step_start, self.memory_state(), running,
            len(self.waiting_queue),
        )
        if self.is_generation:
            self.output_processor.process_batch_result(batch, result)
        else:
            self.output_processor.process_embedding_result(batch, result)
        self.micro_batches.current.last_was_prefill = batch.forward_mode.is_extend
        if batch.forward_mode.is_extend:
            batch.filter_batch()
            self.running_batch.merge_batch(batch)
        else:
            self.running_batch.filter_batch()

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """A prefill batch when one can be admitted, else a decode step of the running batch.

        Right after a prefill the running batch decodes first, so that prefill and decode
        alternate: a stream of arrivals or a long chunked prompt cannot starve running requests.
        """
        self.finish_aborted()
        self._end_waiting_timeouts()
        if not (self.micro_batches.current.last_was_prefill
                and not self.running_batch.is_empty()):
            batch = self._get_new_batch_prefill()
            if batch is not None:
                return batch
        if self.running_batch.is_empty():
            return None
        self._update_running_batch()
        return None if self.running_batch.is_empty() else self.running_batch

    def finish_aborted(self) -> None:
        """Requests marked by an abort leave (and free their KV) before the next batch forms."""
        aborted = [r for r in self.running_batch.reqs if r.to_abort is not None]
        chunked = self.chunked_req
        if chunked is not None and chunked.to_abort is not None and not self._chunk_in_flight():
            aborted.append(chunked)
            self.chunked_req = None
        for req in aborted:
            self.output_processor.finish_now([req], FinishAbort(message=req.to_abort))
        self.num_aborted_reqs += len(aborted)
        if aborted:
            self.running_batch.filter_batch()
        self.intake.run_deferred()

    def _chunk_in_flight(self) -> bool:
        """Whether the chunked request's last chunk is still in the pipeline: its next chunk
        needs that one's KV in the cache (never true without pipelining)."""
        return self.chunked_req is not None and any(
            r is self.chunked_req for r in self.micro_batches.in_flight_reqs()
        )

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self._chunk_in_flight():
            return None
        batch = self._plan_prefill()
        while batch is None and self._preempt_one():
            batch = self._plan_prefill()
        return batch

    def _plan_prefill(self) -> ScheduleBatch | None:
        plan = self.prefill_planner.plan(
            self.waiting_queue,
            self.chunked_req,
            [r for r in self.holding_reqs() if r is not self.chunked_req],
            self.max_running_requests,
            self.settings.max_prefill_tokens,
            self.settings.chunked_prefill_size,
        )
        self.waiting_queue, self.chunked_req = plan.waiting, plan.chunked_req
        return plan.batch

    def _preemption_victim(self) -> Req | None:
        """Priority scheduling: the running request the most important waiting one may
        preempt (``priority_scheduling.py``). Not while a chunked prefill holds KV between
        chunks, nor with pipeline stages (their micro-batches hold requests in flight)."""
        if self.priority is None or self.chunked_req is not None or not self.waiting_queue:
            return None
        if self.parallel.info.pp_size > 1 or self.loop.has_in_flight:
            return None
        candidate = max(self.waiting_queue, key=self.priority.importance)
        return self.priority.victim(candidate, self.running_batch.reqs)

    def _preempt_one(self) -> bool:
        """Retract one preemption victim (its KV to the radix cache, its outputs kept) to the
        waiting queue, so that the next plan may admit the request it makes room for."""
        victim = self._preemption_victim()
        if victim is None:
            return False
        self.running_batch.reqs.remove(victim)
        self.waiting_queue[:0] = retract_all([victim], self.tree_cache)
        self.num_retracted_reqs += 1
        self.num_preempted_reqs += 1
        logger.info("request %r (priority %d) preempted", victim.rid, victim.priority)
        return True

    def _late(self) -> list[Req]:
        """Waiting requests past RADIXSERVE_REQ_WAITING_TIMEOUT."""
        return timed_out(self.waiting_queue, self.settings.waiting_timeout, time.monotonic())

    def _end_waiting_timeouts(self) -> None:
        """Requests that waited past RADIXSERVE_REQ_WAITING_TIMEOUT end with a 503."""
        late = self._late()
        if late:
            ids = {id(r) for r in late}
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in ids]
            reason = FinishAbort(message=WAITING_TIMEOUT_MESSAGE, status_code=503)
            self.output_processor.finish_now(late, reason)

    def _update_running_batch(self) -> None:
        """Make room for one more token per running request (retracting if needed)."""
        result = retract_for_decode(
            self.running_batch, self.new_token_ratio, self.micro_batches.others_hold_kv()
        )
        if result.retracted:
            self.num_retracted_reqs += len(result.retracted)
            self.waiting_queue[:0] = result.retracted
            logger.info(
                "KV cache full: retracted %d request(s); new_token_ratio is now %.3f",
                len(result.retracted),
                self.new_token_ratio.value,
            )
        else:
            self.new_token_ratio.step()
        if result.cannot_fit:
            message = (
                f"out of KV cache memory: the request alone does not fit in the KV pool "
                f"({self.max_total_num_tokens} tokens)"
            )
            reason = FinishAbort(message=message)
            self.output_processor.finish_now(result.cannot_fit, reason)
        if not self.running_batch.is_empty():
            self.running_batch.prepare_for_decode()

    # ------------------------------------------------------------------ handlers
    def handle_abort(self, msg: AbortReq) -> None:
        """Waiting requests finish now; those holding KV are marked and finish at the next step
        (``finish_aborted``), so that a batch in flight is never changed under its feet."""

        def hit(req: Req) -> bool:
            return msg.abort_all or req.rid == msg.rid

        reason = FinishAbort(message=msg.message or "aborted by request",
                             status_code=msg.status_code)
        waiting = [r for r in self.waiting_queue if hit(r)] + self.grammar_queue.remove(hit)
        self.waiting_queue = [r for r in self.waiting_queue if not hit(r)]
        self.output_processor.finish_now(waiting, reason)
        self.num_aborted_reqs += len(waiting)
        for req in self.holding_reqs():
            if hit(req):
                req.to_abort = reason.message
        if self.paused:  # no step is in flight and none will come to finish them
            self.finish_aborted()

    def flush(self) -> None:
        """Drop the prefix cache, session slots and every allocation (idle only)."""
        assert self.is_idle(), "flush while requests hold memory"
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        self.grammars.clear()
        logger.info("cache flushed")

    def handle_get_internal_state(self, msg: GetInternalStateReq) -> GetInternalStateReqOutput:
        self.self_check_during_idle()  # fresh when idle, else the last idle check
        return GetInternalStateReqOutput(
            state={
                "memory": self.memory_state(),
                "num_running_reqs": self.num_running(),
                "num_waiting_reqs": self.num_waiting(),
                "num_grammar_queue_reqs": len(self.grammar_queue),
                "num_cached_grammars": len(self.grammars),
                "max_total_num_tokens": self.max_total_num_tokens,
                "num_retracted_reqs": self.num_retracted_reqs,
                "num_preempted_reqs": self.num_preempted_reqs,
                "num_aborted_reqs": self.num_aborted_reqs,
                "num_overlapped_steps": self.loop.num_steps,
                "paused": self.paused,
                "num_open_sessions": len(self.sessions.sessions),
                "num_session_reqs": self.sessions.num_reqs(),
                "num_live_reqs": num_live_reqs(),
                "max_running_requests": self.max_running_requests,
                **self.stats.summary(),
                **self.loop.summary(),
                "new_token_ratio": self.new_token_ratio.value,
                "last_leak_check": self.last_leak_check,
                "dp_rank": self.dp_rank,
                "num_received_reqs": self.intake.num_received_reqs,
                "num_pipelined_steps": self.micro_batches.num_pipelined_steps,
                "session_ids": sorted(self.sessions.sessions),
            }
        )

    def retract_all(self) -> int:
        """Every running request (and the chunked one) back to the front of the waiting
        queue, its KV freed (a pause in mode ``retract``); how many."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        retracted = retract_all([*self.running_batch.reqs, *chunked], self.tree_cache)
        self.running_batch.reqs, self.chunked_req = [], None
        self.waiting_queue[:0] = retracted
        self.num_retracted_reqs += len(retracted)
        return len(retracted)

    # ------------------------------------------------------------------ memory invariant
    def finish_step_in_flight(self) -> None:
        """Wait for the overlap step in flight, if any, and process its tokens.

        A request's last output goes out while the step launched after it still computes (the
        overlap module's doc), so a client that has every output can find the scheduler busy
        with a step whose requests have all finished. What needs the scheduler idle (a flush, a
        weight update, releasing memory) or nothing computing (a pause) finishes it first.
        """
        self.loop.finish_in_flight()

    def is_idle(self) -> bool:
        return (
            not self.waiting_queue
            and not self.grammar_queue
            and self.micro_batches.is_empty()
            and not self.chunked_req
            and not self.loop.has_in_flight
        )

    def holding_reqs(self) -> list[Req]:
        """Every admitted unfinished request: the running batches of all micro-batches, the
        prefills still in the pipeline and the chunked request, each once."""
        seen = self.micro_batches.holding_reqs()
        if self.chunked_req is not None:
            seen.setdefault(id(self.chunked_req), self.chunked_req)
        return list(seen.values())

    def num_running(self) -> int:
        return len(self.holding_reqs())

    def num_waiting(self) -> int:
        """Requests not yet admitted: waiting, or waiting for their grammar."""
        return len(self.waiting_queue) + len(self.grammar_queue)

    def memory_state(self) -> dict[str, int]:
        """KV and request-slot figures (``memory_check.py``)."""
        return self.memory.figures()

    def self_check_during_idle(self) -> None:
        """Check the memory invariant (``memory_check.py``) when no request runs or waits:
        every KV slot is free, evictable, held for a session or locked by one."""
        if self.is_idle():
            self.last_leak_check = self.memory.check([])

    def check_busy_invariant(self) -> None:
        """``RADIXSERVE_STRICT_MEM_CHECK=busy``: the invariant after every step, counting
        what running requests (and the chunked one) hold."""
        if self.check_busy:
            self.memory.check(self.holding_reqs())

    def request_stop(self) -> None:
        """Leave the loop's ``run_forever`` after the current step (SIGTERM with a session
        store)."""
        self.stop_requested = True

