"""The scheduler process: the loop of docs/architecture.md §4 and the handlers of incoming messages.

    while True:
        process_input_requests(recv_nowait())   # TypeBasedDispatcher: type → handler
        step():  requests whose grammar compiled join the waiting queue (grammar_queue.py)
                 batch = get_next_batch_to_run() # a new prefill if one fits, else a decode step
                 run it, process its result      # output_processor.py
                 or, idle: wait briefly for a grammar that compiles, or
                           self_check_during_idle() and block on the socket
                 (paused: no steps; messages are still handled)

``PauseGenerationReqInput`` stops the steps until ``ContinueGenerationReqInput``; see
``handle_pause_generation``.

With ``--enable-overlap-schedule`` the model runs on a thread of its own (``OverlapWorker``) and
a decode step N+1 is launched before step N's tokens are processed (``overlap_schedule.py``).

Parallel ranks: every rank of a replica runs this scheduler on the same messages
(``RequestReceiver``) and so takes the same decisions; only rank 0 sends outputs and replies.
Grammars compile on each rank, and a step waits until all queued ones are compiled, so that all
ranks admit them at the same step. With pipeline parallelism the running requests form
``pp_size`` micro-batches, each with its own running batch, driven by ``PipelineLoop``
(``pipeline_loop.py``); ``select_micro_batch`` makes one of them the ``running_batch`` the rest
of this class works on.

The single-job objects it composes, built by ``build_scheduler`` (``scheduler_builder.py``):
``SchedulePolicy`` + ``PrefillAdder`` (admission), ``retract_for_decode`` (memory pressure),
``OutputProcessor`` (results), ``TpModelWorker`` (the model), ``GrammarQueue`` (constrained
requests until their grammar is compiled), ``SessionController`` and the prefix cache
(``mem_cache``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    ControlErrorOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadReport,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.request_checks import check_embedding, check_generate
from radixserve.managers.scheduler.grammar_queue import GrammarQueue
from radixserve.managers.scheduler.lora_requests import LoRAControl, bind_lora
from radixserve.managers.scheduler.memory_check import MemoryChecker, busy_check_enabled
from radixserve.managers.scheduler.overlap_schedule import OverlapSchedule
from radixserve.managers.scheduler.request_receiver import RequestReceiver
from radixserve.managers.scheduler.retraction import (
    retract_all,
    retract_for_decode,
)
from radixserve.managers.scheduler.schedule_batch import (
    BatchResources,
    Req,
    ScheduleBatch,
    num_live_reqs,
    pages_to_alloc,
)
from radixserve.managers.scheduler.schedule_policy import (
    AddResult,
    PrefillAdder,
    decode_reservation,
)
from radixserve.managers.scheduler.scheduler_control import SchedulerControl
from radixserve.managers.scheduler.scheduler_stats import SchedulerStats, token_usage
from radixserve.managers.scheduler.watchdog import Watchdog
from radixserve.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.managers.scheduler.scheduler_builder import SchedulerParts, SchedulerSettings

logger = logging.getLogger(__name__)

# How long an idle loop blocks on its socket before looking around again.
IDLE_POLL_MS = 1000
# How long a step with nothing to run waits for a grammar to compile (messages wait meanwhile).
_GRAMMAR_WAIT_S = 0.01


@dataclass
class MicroBatch:
    """One pipeline micro-batch's running requests (the only one without pipelining)."""

    running: ScheduleBatch
    last_was_prefill: bool = False
    # A step of this micro-batch still in the pipeline (its result not processed yet).
    in_flight: ScheduleBatch | None = None


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
        device: torch.device,
        dp_rank: int = 0,
        send_load: Callable[[LoadReport], None] | None = None,
    ) -> None:
        """Built by ``build_scheduler`` (``scheduler_builder.py``), which reads the server's
        arguments and makes ``parts``. ``dp_rank``: the data-parallel replica this rank belongs
        to; ``send_load``: where changes of its load go (the data-parallel controller)."""
        self.settings = settings
        self.send_to_tokenizer = send_to_tokenizer
        self.send_load = send_load
        self._last_load: LoadReport | None = None
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
        self.grammar_queue = GrammarQueue(self.grammars)
        self.sessions = parts.sessions
        self.memory = MemoryChecker(
            self.tree_cache, self.allocator, self.req_to_token_pool, self.max_total_num_tokens
        )
        self.check_busy = busy_check_enabled()
        self.res = BatchResources(
            req_to_token_pool=self.req_to_token_pool,
            allocator=self.allocator,
            tree_cache=self.tree_cache,
            device=device,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            grammars=self.grammars,
        )
        self.policy = parts.policy
        self.new_token_ratio = parts.new_token_ratio
        self.output_processor = parts.output_processor

        self.waiting_queue: list[Req] = []
        self.micro_batches = [
            MicroBatch(ScheduleBatch([], self.res)) for _ in range(self.parallel.info.pp_size)
        ]
        self._mb = self.micro_batches[0]  # the micro-batch running_batch refers to
        self.chunked_req: Req | None = None  # holds KV between its prefill chunks
        # Generate and embedding requests received (the load reports count them).
        self.num_received_reqs = 0
        # Pipeline: batches launched while another micro-batch's step was still in flight.
        self.num_pipelined_steps = 0
        self.num_retracted_reqs = 0
        self.num_aborted_reqs = 0  # running or waiting requests ended by an abort
        # Session turns that arrived while their session's turn in flight was being aborted:
        # judged once the abort took effect (``_finish_aborted``), so that they find it gone.
        self._after_aborts: list[TokenizedGenerateReqInput] = []
        self.last_leak_check: dict[str, Any] = {}
        self.stop_requested = False
        self.idle_checked = False  # the idle self-check ran since the last step
        self.overlap = None if parts.overlap is None else OverlapSchedule(self, parts.overlap)
        self.paused = False  # by PauseGenerationReqInput: no step runs until continued
        self.stats = SchedulerStats()
        self.control = SchedulerControl(self)
        self._step_start = time.perf_counter()
        self._inject_faults = envs.RADIXSERVE_TEST_INJECT_FAULTS.get()

        self.dispatcher = TypeBasedDispatcher(
            [
                (TokenizedGenerateReqInput, self.handle_generate_request),
                (TokenizedEmbeddingReqInput, self.handle_embedding_request),
                (AbortReq, self.handle_abort),
                (FlushCacheReq, self.handle_flush_cache),
                (GetInternalStateReq, self.handle_get_internal_state),
                (OpenSessionReqInput, self.handle_open_session),
                (CloseSessionReqInput, self.handle_close_session),
                (PauseGenerationReqInput, self.handle_pause_generation),
                (ContinueGenerationReqInput, self.handle_continue_generation),
                *self.control.handlers(),
                *LoRAControl(self.tp_worker.model_runner.lora).handlers(),
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

    # ------------------------------------------------------------------ micro-batches
    @property
    def running_batch(self) -> ScheduleBatch:
        return self._mb.running

    @running_batch.setter
    def running_batch(self, batch: ScheduleBatch) -> None:
        self._mb.running = batch

    def select_micro_batch(self, index: int) -> MicroBatch:
        """Make micro-batch ``index`` the one ``running_batch`` refers to (pipeline loop)."""
        self._mb = self.micro_batches[index]
        return self._mb

    def _in_flight_reqs(self) -> list[Req]:
        return [r for mb in self.micro_batches if mb.in_flight for r in mb.in_flight.reqs]

    # ------------------------------------------------------------------ the loop
    def event_loop(self, receiver: RequestReceiver) -> None:
        """Run until ``stop_requested``; an idle scheduler blocks on its input instead of
        spinning. The watchdog ends the process if one step hangs for ``--watchdog-timeout``
        seconds. On a stop, streaming sessions are written to a session store that outlives the
        process (``--session-store``), so that a restarted server resumes them."""
        watchdog = Watchdog(self.settings.watchdog_timeout)
        watchdog.start()
        while not self.stop_requested:
            self.process_input_requests(receiver.recv())
            watchdog.step_started()
            busy = self.step()
            watchdog.step_finished()
            self.report_load()
            if not busy:
                receiver.wait(IDLE_POLL_MS)
        self.sessions.persist_all()

    def report_load(self) -> None:
        """Tell the data-parallel controller this replica's load, when it changed."""
        if self.send_load is None:
            return
        used, _ = token_usage(self.memory_state())
        load = LoadReport(
            dp_rank=self.dp_rank,
            num_reqs=self.num_running() + self.num_waiting(),
            num_waiting_reqs=self.num_waiting(),
            num_tokens=used,
            num_received=self.num_received_reqs,
        )
        if load != self._last_load:
            self._last_load = load
            self.send_load(load)

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

    def step(self) -> bool:
        """Run one batch; False when there was nothing to run or generation is paused."""
        if self.paused:
            self.sessions.on_step()
            return False
        if self.overlap is not None:
            return self.overlap.step()
        self.begin_step()
        batch = self.get_next_batch_to_run()
        if batch is None:
            return self.on_idle()
        result = self.run_batch(batch)
        assert result is not None, "without pipelining every rank has the step's outcome"
        self.process_batch_result(batch, result)
        self.check_busy_invariant()
        return True

    def begin_step(self) -> None:
        """A step starts: sessions' housekeeping, compiled grammars join the waiting queue, and
        the step's duration starts (it goes to the step statistics)."""
        self.sessions.on_step()
        self._admit_compiled_grammars()
        self._step_start = time.perf_counter()

    def run_batch(self, batch: ScheduleBatch) -> SampleOutput | torch.Tensor | None:
        """The model step of ``batch``: its tokens (an embedding model: its embeddings), or
        None on a pipeline stage that does not sample (the tokens come round the pipeline)."""
        self.idle_checked = False
        forward_batch = batch.to_forward_batch()
        if self.is_generation:
            result = self.tp_worker.forward_batch_generation(forward_batch)
        else:
            result = self.tp_worker.forward_batch_embedding(forward_batch)
        self.control.after_step()
        return result

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
        self._mb.last_was_prefill = batch.forward_mode.is_extend
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
        self._finish_aborted()
        if not (self._mb.last_was_prefill and not self.running_batch.is_empty()):
            batch = self._get_new_batch_prefill()
            if batch is not None:
                return batch
        if self.running_batch.is_empty():
            return None
        self._update_running_batch()
        return None if self.running_batch.is_empty() else self.running_batch

    def _finish_aborted(self) -> None:
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
        deferred, self._after_aborts = self._after_aborts, []
        for msg in deferred:
            self.handle_generate_request(msg)

    def _chunk_in_flight(self) -> bool:
        """Whether the chunked request's last chunk is still in the pipeline: its next chunk
        needs that one's KV in the cache (never true without pipelining)."""
        return self.chunked_req is not None and any(
            r is self.chunked_req for r in self._in_flight_reqs()
        )

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self._chunk_in_flight():
            return None
        # Every micro-batch's requests count against the limits (and hold KV to decode).
        running = [r for r in self.holding_reqs() if r is not self.chunked_req]
        free_running = self.max_running_requests - len(running) - (self.chunked_req is not None)
        if self.req_to_token_pool.available_size() == 0:
            # Idle sessions must not starve new requests of rows: their KV goes to the store
            # (or is dropped). Give back no more than can be admitted, sparing sessions whose
            # own turn waits (it takes its slot's row over).
            self.tree_cache.evict_session_rows(
                min(len(self.waiting_queue), free_running),
                spare={r.streaming_session_id for r in self.waiting_queue},
            )
        # Offloaded sessions of waiting turns come back first, within what admission could
        # give them: free and reclaimable KV less what running requests will still decode.
        reserved = sum(decode_reservation(r, self.new_token_ratio.value) for r in running)
        self.tree_cache.load_back(
            self.waiting_queue,
            self.allocator.available_size() + self.tree_cache.reclaimable_size() - reserved,
            min(self.req_to_token_pool.available_size(), free_running),
        )
        adder = PrefillAdder(
            tree_cache=self.tree_cache,
            allocator=self.allocator,
            running_reqs=running,
            new_token_ratio=self.new_token_ratio.value,
            max_prefill_tokens=self.settings.max_prefill_tokens,
            chunked_prefill_size=self.settings.chunked_prefill_size,
            free_rows=self.req_to_token_pool.available_size(),
            free_running=free_running,
            allow_chunking=not self.model_config.is_encoder,
        )
        if self.chunked_req is not None:
            if adder.add_chunked_req(self.chunked_req) is AddResult.CONTINUE:
                self.chunked_req = None  # its last chunk runs now
        if self.chunked_req is None:
            self.policy.calc_priority(self.waiting_queue)
            for req in self.waiting_queue:
                if adder.add_one_req(req) is AddResult.STOP:
                    break
            if adder.new_chunked_req is not None:
                self.chunked_req = adder.new_chunked_req
        if not adder.can_run:
            return None
        admitted = {id(r) for r in adder.can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        batch = ScheduleBatch(adder.can_run, self.res)
        batch.prepare_for_extend()
        return batch

    def _update_running_batch(self) -> None:
        """Make room for one more token per running request (retracting if needed)."""
        others_hold_kv = any(
            mb is not self._mb and (mb.in_flight is not None or not mb.running.is_empty())
            for mb in self.micro_batches
        )
        result = retract_for_decode(self.running_batch, self.new_token_ratio, others_hold_kv)
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
    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        self.num_received_reqs += 1
        turn = None
        if not self.is_generation or self.control.released:
            req = Req(msg.rid, list(msg.input_ids), msg.sampling_params)
            if self.control.released:
                self._reject(req, self._released_message(), status_code=503)
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
                self.handle_abort(AbortReq(rid=replaced))
            if self._aborting(replaced or self.sessions.inflight_rid(msg)):
                self._after_aborts.append(msg)
                return
        if msg.session_params is not None:
            turn = self.sessions.plan(msg)
            req, error = Req.from_message(msg, turn.input_ids), turn.error
            req.streaming_session_id = turn.streaming_session_id
        else:
            req, error = Req.from_message(msg, list(msg.input_ids)), None
        error = error or self._validate(req.origin_input_ids, msg)
        error = error or bind_lora(req, msg.lora_path, self.tp_worker.model_runner.lora)
        if error is not None:
            self._reject(req, error)
            return
        if turn is not None:
            for replaced in self.sessions.admit(turn, req):
                self.handle_abort(AbortReq(rid=replaced.rid))
        if msg.sampling_params.grammar is not None:
            self.grammar_queue.add(req)
        else:
            self.waiting_queue.append(req)

    def handle_embedding_request(self, msg: TokenizedEmbeddingReqInput) -> None:
        """Queue an embedding: a prefill that samples nothing (``max_new_tokens`` 0)."""
        self.num_received_reqs += 1
        req = Req(msg.rid, list(msg.input_ids), SamplingParams(max_new_tokens=0))
        if self.control.released:
            self._reject(req, self._released_message(), status_code=503)
            return
        if self.is_generation:
            error = "this server serves a generation model: start it with --is-embedding"
        else:
            error = self._validate_embedding(req.origin_input_ids)
        if error is not None:
            self._reject(req, error)
            return
        self.waiting_queue.append(req)

    def _released_message(self) -> str:
        return (
            f"the server's memory is released ({sorted(self.control.released)}): "
            "resume_memory_occupation first"
        )

    def _validate_embedding(self, ids: list[int]) -> str | None:
        try:
            check_embedding(ids, vocab_size=self.model_config.vocab_size,
                            context_len=self.model_config.context_len)
        except ValueError as e:
            return str(e)
        # An encoder's input is encoded in one step: it must fit one prefill batch.
        budget = min(self.settings.max_prefill_tokens, self.settings.chunked_prefill_size)
        if self.model_config.is_encoder and len(ids) > budget:
            return f"the input ({len(ids)} tokens) exceeds the prefill budget ({budget} tokens)"
        if pages_to_alloc(0, len(ids), self.page_size) > self.max_total_num_tokens:
            return (
                f"the input ({len(ids)} tokens) does not fit in the KV cache "
                f"({self.max_total_num_tokens} tokens)"
            )
        return None

    def _reject(self, req: Req, error: str, status_code: int = 400) -> None:
        logger.info("request %r rejected: %s", req.rid, error)
        # status_code 400: bad input, raised to the caller as a ValueError; 503: unavailable.
        reason = FinishAbort(message=error, status_code=status_code)
        self.output_processor.finish_now([req], reason)

    def _validate(self, ids: list[int], msg: TokenizedGenerateReqInput) -> str | None:
        """Why the request cannot run, or None. It never reaches the model when rejected.

        ``ids`` is the whole prompt (for a session request: as assembled from its session):
        the TokenizerManager's checks again (``request_checks``), then the KV pool's size.
        """
        try:
            check_generate(
                ids, msg.sampling_params,
                vocab_size=self.model_config.vocab_size,
                context_len=self.model_config.context_len,
                return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                top_logprobs_num=msg.top_logprobs_num, token_ids_logprob=msg.token_ids_logprob,
            )
        except ValueError as e:
            return str(e)
        if pages_to_alloc(0, len(ids) + 1, self.page_size) > self.max_total_num_tokens:
            return (
                f"the prompt ({len(ids)} tokens) does not fit in the KV cache "
                f"({self.max_total_num_tokens} tokens)"
            )
        return None

    def _aborting(self, rid: str | None) -> bool:
        """Whether ``rid`` is a request an abort has marked, which ends at the next step."""
        if rid is None:
            return False
        return any(r.rid == rid and r.to_abort is not None for r in self.holding_reqs())

    def handle_abort(self, msg: AbortReq) -> None:
        """Waiting requests finish now; those holding KV are marked and finish at the next step
        (``_finish_aborted``), so that a batch in flight is never changed under its feet."""

        def hit(req: Req) -> bool:
            return msg.abort_all or req.rid == msg.rid

        reason = FinishAbort(message="aborted by request")
        waiting = [r for r in self.waiting_queue if hit(r)] + self.grammar_queue.remove(hit)
        self.waiting_queue = [r for r in self.waiting_queue if not hit(r)]
        self.output_processor.finish_now(waiting, reason)
        self.num_aborted_reqs += len(waiting)
        for req in self.holding_reqs():
            if hit(req):
                req.to_abort = reason.message
        if self.paused:  # no step is in flight and none will come to finish them
            self._finish_aborted()

    def handle_flush_cache(self, msg: FlushCacheReq) -> FlushCacheReqOutput:
        self.finish_step_in_flight()
        if not self.is_idle():
            return FlushCacheReqOutput(
                success=False,
                message=(
                    f"cannot flush the cache while requests run or wait "
                    f"({self.num_running()} running, {self.num_waiting()} waiting)"
                ),
            )
        self.flush()
        return FlushCacheReqOutput(success=True)

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
                "num_aborted_reqs": self.num_aborted_reqs,
                "num_overlapped_steps": self.overlap.num_steps if self.overlap else 0,
                "paused": self.paused,
                "num_open_sessions": len(self.sessions.sessions),
                "num_session_reqs": self.sessions.num_reqs(),
                "num_live_reqs": num_live_reqs(),
                "max_running_requests": self.max_running_requests,
                **self.stats.summary(),
                "new_token_ratio": self.new_token_ratio.value,
                "last_leak_check": self.last_leak_check,
                "dp_rank": self.dp_rank,
                "num_received_reqs": self.num_received_reqs,
                "num_pipelined_steps": self.num_pipelined_steps,
                "session_ids": sorted(self.sessions.sessions),
            }
        )

    def handle_pause_generation(self, msg: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        """Stop running batches (see ``PauseGenerationReqInput`` for the modes).

        The step in flight (overlap schedule) is finished and its tokens processed first, so the
        reply means: nothing computes until ``handle_continue_generation``. Aborts arriving
        while paused take effect at once, as no step will come to finish the marked requests.
        Pausing a paused scheduler applies the new mode to what is there.
        """
        self.paused = True
        self.finish_step_in_flight()
        aborted_before = self.num_aborted_reqs
        self._finish_aborted()
        retracted: list[Req] = []
        if msg.mode == "abort":
            self.handle_abort(AbortReq(abort_all=True))
        elif msg.mode == "retract":
            chunked = [self.chunked_req] if self.chunked_req is not None else []
            retracted = retract_all([*self.running_batch.reqs, *chunked], self.tree_cache)
            self.running_batch.reqs, self.chunked_req = [], None
            self.waiting_queue[:0] = retracted
            self.num_retracted_reqs += len(retracted)
        aborted = self.num_aborted_reqs - aborted_before
        logger.info("generation paused (%s): %d request(s) aborted, %d retracted",
                    msg.mode, aborted, len(retracted))
        return PauseGenerationReqOutput(num_aborted=aborted, num_retracted=len(retracted))

    def handle_continue_generation(
        self, msg: ContinueGenerationReqInput
    ) -> ContinueGenerationReqOutput:
        if self.paused:
            logger.info("generation continued")
        self.paused = False
        return ContinueGenerationReqOutput()

    def handle_open_session(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        return self.sessions.open(msg)

    def handle_close_session(self, msg: CloseSessionReqInput) -> None:
        self.sessions.close(msg.session_id)

    # ------------------------------------------------------------------ memory invariant
    def finish_step_in_flight(self) -> None:
        """Wait for the overlap step in flight, if any, and process its tokens.

        A request's last output goes out while the step launched after it still computes (the
        overlap module's doc), so a client that has every output can find the scheduler busy
        with a step whose requests have all finished. What needs the scheduler idle (a flush, a
        weight update, releasing memory) or nothing computing (a pause) finishes it first.
        """
        if self.overlap is not None:
            self.overlap.finish_in_flight()

    def is_idle(self) -> bool:
        return (
            not self.waiting_queue
            and not self.grammar_queue
            and all(mb.running.is_empty() and mb.in_flight is None for mb in self.micro_batches)
            and not self.chunked_req
            and (self.overlap is None or self.overlap.in_flight is None)
        )

    def holding_reqs(self) -> list[Req]:
        """Every admitted unfinished request: the running batches of all micro-batches, the
        prefills still in the pipeline and the chunked request, each once."""
        seen: dict[int, Req] = {}
        for mb in self.micro_batches:
            for req in mb.running.reqs:
                seen[id(req)] = req
        for req in self._in_flight_reqs():
            seen.setdefault(id(req), req)
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
        """Leave ``event_loop`` after the current step (SIGTERM with a session store)."""
        self.stop_requested = True

