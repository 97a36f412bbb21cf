"""TokenizerManager: the server-side end of every request (runs on one asyncio loop).

Flow of a generate call::

    generate_request(GenerateReqInput)
        normalize → tokenize → validate ALL prompts (ValueError before anything is sent)
        → register one ReqState per rid → TokenizedGenerateReqInput ──ZMQ──▶ scheduler
    handle_loop (task reading the PULL socket)
        BatchStrOutput (from the detokenizer) → append to the rid's state → wake its generate call
        replies of control requests (flush, internal state, sessions, pause, ...) → the
        ``ControlClient`` (``control_client.py``), which completes the waiting caller's future
        (with ``--dp-size N`` a control request goes to every replica and its future completes
        with the N replies; a session's open goes to one replica)
    generate_request yields SGLang-shaped dicts built from the state; when its consumer stops
    early (generator closed, task cancelled: a client disconnect) it sends AbortReq for every
    request of the call that has not finished.

An embedding model (encoder, or ``--is-embedding``) takes ``encode_request`` instead: the same
validation and abort handling, TokenizedEmbeddingReqInput to the scheduler, and one
BatchEmbeddingOutput back from the scheduler directly (no detokenizer on that path).

All methods must be called on the loop that runs ``handle_loop``; the ``Engine`` bridges threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.finish_reason import FinishAbort, FinishReason
from radixserve.managers import io_struct, ipc
from radixserve.managers.caller import abort_targets, current_caller
from radixserve.managers.tokenizer.control_client import ControlClient
from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.managers.tokenizer.logprob_meta import LogprobMeta
from radixserve.managers.tokenizer.queue_eviction import (
    EVICTED_MESSAGE,
    EVICTED_STATUS,
    importance,
    pick_evictions,
)
from radixserve.managers.tokenizer.request_state import (
    CapacityError,
    ReqState,
    RequestMetrics,
    ServiceUnavailableError,
    raise_if_rejected,
    session_id_of,
    session_ids_of,
)
from radixserve.managers.tokenizer.request_tokenizer import RequestTokenizer
from radixserve.managers.tokenizer.request_values import describe, find_unrepresentable
from radixserve.server_args import ServerArgs
from radixserve.sessions.session import RESUME_NEEDS_ID, check_session_id

logger = logging.getLogger(__name__)

# Event loop rounds a session request waits for an earlier request of its session to be
# cancelled by a disconnect the server has already read (``_let_disconnects_land``): two at
# most were seen under the session stress test's load.
_DISCONNECT_ROUNDS = 32
@dataclass(frozen=True)
class PreparedGenerate:
    """A call's requests, validated and encoded, not yet sent (``prepare_generate``)."""

    obj: GenerateReqInput
    reqs: list[Any]  # TokenizedGenerateReqInput / TokenizedEmbeddingReqInput, one per prompt
    frames: list[bytes]  # the same, encoded
    logprobs: list[LogprobMeta | None] | None = None  # collects request i's, when it asked


class TokenizerManager:
    """Tokenizes and validates requests, sends them to the scheduler, routes outputs back."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: ipc.PortArgs,
        model_config: Any,
        *,
        on_request_finished: Callable[[RequestMetrics], None] | None = None,
    ) -> None:
        from radixserve.tokenizer_loader import load_tokenizer

        self.server_args = server_args
        self.model_config = model_config
        self.tokenizer = load_tokenizer(server_args.tokenizer)
        self.request_tokenizer = RequestTokenizer(
            self.tokenizer, model_config.vocab_size, model_config.context_len,
            max_completion_tokens=server_args.max_completion_tokens,
            max_top_logprobs_num=server_args.max_top_logprobs_num,
            dp_size=server_args.dp_size,
            enable_lora=server_args.enable_lora,
            enable_priority_scheduling=server_args.enable_priority_scheduling,
            lora_adapters=server_args.lora_path_map,
        )
        # Called (on the loop) once per finished request; e.g. the HTTP layer's Prometheus hook.
        self.on_request_finished = on_request_finished
        self._ctx = zmq.asyncio.Context()
        self._recv_sock = ipc.pull_socket(self._ctx, port_args.tokenizer_input)
        self._send_ctx = zmq.Context()
        self._send_sock = ipc.push_socket(self._send_ctx, port_args.scheduler_input)
        self._states: dict[str, ReqState] = {}
        self._task: asyncio.Task | None = None
        self._dead_message: str | None = None
        # Embedding models (an encoder, or a decoder served with --is-embedding) only encode.
        self.is_generation = not (server_args.is_embedding or model_config.is_encoder)
        # Control requests (weights, memory, pause, flush, ...) and liveness pings.
        self.control = ControlClient(
            self._send_msg, self._check_alive, server_args.dp_size, server_args.watchdog_timeout
        )
        # Admission: closed while weights are swapped or memory released (requests wait);
        # while memory is released, requests get ServiceUnavailableError.
        self._admission = asyncio.Event()
        self._admission.set()
        self._exclusive = asyncio.Lock()  # one weights/memory operation at a time
        self.memory_released: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin the receive loop on the running asyncio loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.handle_loop())

    def shutdown(self) -> None:
        """Stop receiving, fail whatever still waits, close the sockets (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._dead_message is None:
            self.fail_all("the server is shutting down")
        self._recv_sock.close(linger=0)
        self._send_sock.close(linger=0)
        self._ctx.term()
        self._send_ctx.term()

    def fail_all(self, message: str) -> None:
        """Mark the backend unusable (e.g. a child process died): waiting calls raise."""
        self._dead_message = message
        for state in list(self._states.values()):
            state.notify.set()
        self.control.fail_all(message)

    @property
    def num_inflight(self) -> int:
        """Requests sent to the scheduler that have not finished (for --max-queued-requests)."""
        return len(self._states)

    # ------------------------------------------------------------------ generate
    def prepare_generate(self, obj: GenerateReqInput) -> PreparedGenerate:
        """Normalize, tokenize, validate and encode every prompt of a generate call: any
        ``ValueError`` comes from here, before anything is registered or sent. Callers that
        start several generations at once (the OpenAI routes' choices) prepare them all first,
        so that a bad one fails the call before the others run."""
        self._check_alive()
        if not self.is_generation:
            raise ValueError(
                "this server serves an embedding model: use /encode or /v1/embeddings"
            )
        obj.normalize()
        reqs = [self.request_tokenizer.generate(obj[i], i if not obj.is_single else None)
                for i in range(obj.batch_size)]
        return PreparedGenerate(
            obj=obj,
            reqs=reqs,
            frames=[self._encode(req, f"prompt {i}: " if not obj.is_single else "")
                    for i, req in enumerate(reqs)],
            logprobs=[self._logprob_meta(req, obj.return_text_in_logprobs) for req in reqs],
        )

    async def generate_request(
        self, obj: GenerateReqInput | PreparedGenerate
    ) -> AsyncIterator[dict[str, Any] | list[dict[str, Any]]]:
        """Validate (unless ``prepare_generate`` did), send and yield outputs (see the module
        docstring for the shapes).

        single non-stream: one final dict; single stream: cumulative dicts, the last with a
        ``finish_reason``; batch non-stream: one list of dicts in input order; batch stream:
        cumulative dicts with an ``"index"`` key into the batch.
        """
        prepared = obj if isinstance(obj, PreparedGenerate) else self.prepare_generate(obj)
        obj = prepared.obj
        await self._let_disconnects_land(session_ids_of(obj))
        await self._admit()  # the last await before the requests are sent
        self._check_alive()
        with self._in_flight(prepared, log_metrics=obj.log_metrics) as states:
            notify = states[0].notify
            while True:
                await notify.wait()
                notify.clear()
                self._check_alive()
                raise_if_rejected(states, obj.is_single)
                done = all(s.finished for s in states)
                if obj.stream:
                    for i, state in enumerate(states):
                        if state.dirty:
                            state.dirty = False
                            out = state.to_dict()
                            if not obj.is_single:
                                out["index"] = i
                            yield out
                elif done:
                    outs = [s.to_dict() for s in states]
                    yield outs[0] if obj.is_single else outs
                if done:
                    return

    @contextlib.contextmanager
    def _in_flight(
        self, prepared: PreparedGenerate, log_metrics: bool = True
    ) -> Iterator[list[ReqState]]:
        """The only way a request's state enters ``_states``. The requests come encoded (a
        value the wire cannot carry was refused while preparing, so a batch is sent whole or
        not at all); one state per request (sharing one notify event) is registered and the
        requests are sent as one multipart message, whose parts ZMQ delivers together: the
        scheduler reads a batch in one drain and can prefill it in one step (SGLang sends a
        ``BatchTokenizedGenerateReqInput``), where single sends let it start on the first few.
        However the block ends (finished, an error, a cancelled or closed caller), the
        requests that have not finished are aborted and their states dropped."""
        reqs, frames, logprobs = prepared.reqs, prepared.frames, prepared.logprobs
        for req in reqs:
            if req.rid in self._states:
                raise ValueError(f"request id {req.rid!r} is already in flight")
        notify = asyncio.Event()
        now = time.perf_counter()
        states = [
            ReqState(
                rid=req.rid,
                notify=notify,
                logprobs=logprobs[i] if logprobs else None,
                metrics=RequestMetrics(rid=req.rid, arrival_time=now),
                log_metrics=log_metrics,
                session_id=session_id_of(req),
                owner=current_caller.get(),
                priority=getattr(req, "priority", None),
            )
            for i, req in enumerate(reqs)
        ]
        try:
            self._states.update((state.rid, state) for state in states)
            self._send_sock.send_multipart(frames, copy=False)
            yield states
        finally:
            self._abort_unfinished(states)

    def _send_msg(self, msg: io_struct._Msg) -> None:
        self._send_sock.send(self._encode(msg), copy=False)

    def _encode(self, msg: io_struct._Msg, where: str = "") -> bytes:
        """``msg`` as the scheduler receives it; ``ValueError`` naming the field that cannot
        be sent, after ``where`` (the HTTP layer refuses such values first; ``Engine`` callers
        get here)."""
        try:
            return io_struct.encode(msg)
        except (OverflowError, UnicodeEncodeError) as e:  # an int past 64 bits, a surrogate
            found = find_unrepresentable(msgspec.to_builtins(msg))
            why = describe(*found) if found else f"the request cannot be sent: {e}"
            raise ValueError(where + why) from e

    # ------------------------------------------------------------------ embeddings
    def prepare_embedding(
        self, obj: GenerateReqInput, token_type_ids: list[list[int]] | None = None
    ) -> PreparedGenerate:
        """Normalize, tokenize, validate and encode every input of an embedding call (the
        HTTP routes run this off the event loop for a large body: ``server/off_loop.py``).
        ``token_type_ids``: the segments of each input's ids (cross-encoder pairs)."""
        self._check_alive()
        if self.is_generation:
            raise ValueError(
                "this server serves a generation model: start it with --is-embedding to embed "
                "with a decoder checkpoint"
            )
        obj.normalize()
        reqs = []
        for i in range(obj.batch_size):
            try:
                types = None if token_type_ids is None else token_type_ids[i]
                reqs.append(self.request_tokenizer.embedding(obj[i], types))
            except ValueError as e:
                raise ValueError(f"input {i}: {e}" if not obj.is_single else str(e)) from e
        return PreparedGenerate(obj, reqs, [self._encode(req) for req in reqs])

    async def encode_request(
        self, obj: GenerateReqInput | PreparedGenerate,
        token_type_ids: list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embed ``obj``'s one input (→ dict) or batch (→ list, in input order). An embedding
        reads only ``text`` or ``input_ids``, and ``rid``: it samples nothing.

        Each output is ``{"embedding": [float, ...], "meta_info": {"id", "prompt_tokens",
        "cached_tokens", "finish_reason"}}``. Invalid input raises ``ValueError`` before anything
        is sent (``prepare_embedding``, unless the caller did it); cancelling the call aborts its
        unfinished requests.
        """
        if isinstance(obj, PreparedGenerate):
            prepared = obj
        else:
            prepared = self.prepare_embedding(obj, token_type_ids)
        obj = prepared.obj
        await self._admit()  # the last await before the requests are sent
        self._check_alive()
        with self._in_flight(prepared) as states:
            while not all(s.finished for s in states):
                await states[0].notify.wait()
                states[0].notify.clear()
                self._check_alive()
            raise_if_rejected(states, obj.is_single)
            outs = [s.to_embedding_dict() for s in states]
            return outs[0] if obj.is_single else outs

    def _abort_unfinished(self, states: list[ReqState]) -> None:
        """The caller stopped waiting: abort (and report) its requests that have not finished."""
        for state in states:
            if not state.finished and self._states.pop(state.rid, None) is state:
                if self._dead_message is None:
                    self._send_msg(io_struct.AbortReq(rid=state.rid))
                self._report(state, FinishAbort(message="the caller stopped reading"))

    def _logprob_meta(
        self, req: io_struct.TokenizedGenerateReqInput, with_text: bool
    ) -> LogprobMeta | None:
        if not req.return_logprob:
            return None
        decode = None
        if with_text:
            def decode(ids: list[int]) -> list[str]:
                return self.tokenizer.batch_decode([[t] for t in ids])
        return LogprobMeta(req.top_logprobs_num, req.token_ids_logprob, decode)

    async def _let_disconnects_land(self, sessions: set[str]) -> None:
        """Before a session's request goes out while an earlier request of the same session
        is still in flight here, let the loop run a few rounds: when that earlier request's
        client has just gone away (the usual reason for a next turn to come at once), the
        server has read the disconnect already and the earlier request's abort goes out first,
        so that the scheduler sees the turn after the abort. Rounds of the loop, not time:
        a client that is really still there is answered as before."""
        if not sessions:
            return
        for _ in range(_DISCONNECT_ROUNDS):
            if not any(s.session_id in sessions for s in self._states.values()):
                return
            await asyncio.sleep(0)

    def _check_alive(self) -> None:
        if self._dead_message is not None:
            raise RuntimeError(self._dead_message)

    # ------------------------------------------------------------------ receive
    async def handle_loop(self) -> None:
        """Route every message from the detokenizer and the scheduler (runs until cancelled)."""
        while True:
            data = await self._recv_sock.recv()
            try:
                self._dispatch(io_struct.decode(data))
            except Exception:  # one bad message must not stop every request's outputs
                logger.exception("tokenizer manager failed to handle a message")

    def _dispatch(self, msg: io_struct.Message) -> None:
        if isinstance(msg, io_struct.BatchStrOutput):
            for out in msg.outputs:
                try:
                    self._handle_output(out)
                except Exception as e:  # end that request with the error, never leave it hanging
                    logger.exception("failed to handle an output of request %r", out.rid)
                    self._fail_request(out.rid, f"internal error: {type(e).__name__}: {e}")
        elif isinstance(msg, io_struct.BatchEmbeddingOutput):
            for emb in msg.outputs:
                self._handle_embedding(emb)
        elif not self.control.on_message(msg):
            logger.warning("tokenizer manager ignores message %s", type(msg).__name__)

    def _handle_output(self, out: io_struct.ReqStrOutput) -> None:
        state = self._states.get(out.rid)
        if state is None:  # aborted by its consumer, outputs may still be in flight
            return
        now = time.perf_counter()
        state.text += out.new_text
        state.output_ids.extend(out.new_token_ids)
        state.prompt_tokens = out.prompt_tokens
        state.completion_tokens = out.completion_tokens
        state.cached_tokens = out.cached_tokens
        state.cached_tokens_details = out.cached_tokens_details
        if state.logprobs is not None and out.logprobs is not None:
            state.logprobs.add(out.logprobs, out.new_token_ids)
        metrics = state.metrics
        if out.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.token_times.append((now, len(out.new_token_ids)))
        if out.finished_reason is not None:
            state.finished = True
            state.finished_reason = out.finished_reason
            del self._states[out.rid]
            self._report(state, out.finished_reason)
        state.dirty = True
        state.notify.set()

    def _fail_request(self, rid: str, message: str) -> None:
        """Finish ``rid`` as aborted here (the scheduler finishes it on its own)."""
        state = self._states.pop(rid, None)
        if state is None:
            return
        state.finished = True
        state.finished_reason = FinishAbort(message=message)
        state.dirty = True
        state.notify.set()
        self._report(state, state.finished_reason)

    def _handle_embedding(self, out: io_struct.ReqEmbeddingOutput) -> None:
        state = self._states.pop(out.rid, None)
        if state is None:  # aborted by its caller
            return
        state.embedding = out.embedding
        state.prompt_tokens = out.prompt_tokens
        state.cached_tokens = out.cached_tokens
        state.finished = True
        state.finished_reason = out.finished_reason
        self._report(state, out.finished_reason)
        state.notify.set()

    def _report(self, state: ReqState, reason: FinishReason) -> None:
        """Complete the request's metrics and hand them to the callback, if any (and the
        request did not opt out with ``log_metrics`` false)."""
        if not state.log_metrics:
            return
        metrics = state.metrics
        metrics.prompt_tokens = state.prompt_tokens
        metrics.cached_tokens = state.cached_tokens
        metrics.cached_tokens_details = state.cached_tokens_details
        metrics.completion_tokens = state.completion_tokens
        metrics.finish_time = time.perf_counter()
        metrics.finish_reason = reason
        if self.on_request_finished is not None:
            try:
                self.on_request_finished(metrics)
            except Exception:  # a metrics bug must not break serving
                logger.exception("on_request_finished callback failed")

    # ------------------------------------------------------------------ control requests
    # Those that need this manager's state; the others go through ``self.control`` directly.
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Ask the scheduler to abort ``rid`` (or everything); the request finishes as abort.

        A rid is aborted only for the caller that sent it, and the rid of a batch or of n > 1
        aborts all their generations (``caller.abort_targets``); aborting an unknown rid does
        nothing. ``abort_all`` is the HTTP edge's to allow (an admin route when an admin key is
        configured)."""
        self._check_alive()
        owners = {r: state.owner for r, state in self._states.items()}
        one_rid = rid and not abort_all
        for one in abort_targets(rid, owners, current_caller.get()) if one_rid else [rid]:
            self._send_msg(io_struct.AbortReq(rid=one, abort_all=abort_all))

    def evict_for_priority(self, priority: int | None, needed: int) -> bool:
        """Evict waiting requests less important than ``priority`` so that ``needed`` more
        generations fit under ``--max-queued-requests`` (``queue_eviction.py``); whether it
        did. The evicted end with SGLang's 503."""
        args = self.server_args
        victims = pick_evictions(list(self._states.values()), importance(priority, args),
                                 needed, args)
        for state in victims:
            state.evicted = True
            self._send_msg(io_struct.AbortReq(rid=state.rid, message=EVICTED_MESSAGE,
                                              status_code=EVICTED_STATUS))
        return bool(victims)

    async def open_session(self, req: io_struct.OpenSessionReqInput) -> str:
        """Open a session and return its id; ``ValueError`` with the scheduler's reason.

        A session without an id gets one here, so that every rank and the data-parallel
        controller know it by the same name."""
        if req.capacity_of_str_len <= 0:
            raise ValueError(
                f"capacity_of_str_len must be positive, got {req.capacity_of_str_len}"
            )
        if req.session_id is None:
            if req.resume:
                raise ValueError(RESUME_NEEDS_ID)
            req = msgspec.structs.replace(req, session_id=uuid.uuid4().hex)
        [reply] = await self.control.call_all(req, fan_out=1)
        if reply.at_capacity:
            raise CapacityError(reply.message)
        if not reply.success or reply.session_id is None:
            raise ValueError(reply.message or "failed to open the session")
        return reply.session_id

    async def close_session(self, session_id: str) -> None:
        """Close a session (unknown ids are ignored); ``ValueError`` for a malformed id."""
        self._check_alive()
        check_session_id(session_id)
        self._send_msg(io_struct.CloseSessionReqInput(session_id=session_id))

    async def pause_generation(self, mode: str = "abort") -> io_struct.PauseGenerationReqOutput:
        """Pause the scheduler; returns once the pause holds (``ValueError`` for a bad mode).

        New requests are still accepted and queue up in the scheduler. With ``abort``, the
        call also waits until every request it aborted has returned to its caller.
        """
        if mode not in io_struct.PAUSE_MODES:
            modes = ", ".join(io_struct.PAUSE_MODES)
            raise ValueError(f"mode must be one of {modes}, got {mode!r}")
        if self.server_args.pp_size > 1:
            # the micro-batches in the pipeline cannot be held between stages
            raise ValueError("pause_generation does not combine with pipeline parallelism")
        in_flight = set(self._states)
        replies = await self.control.call_all(
            io_struct.PauseGenerationReqInput(mode=mode),  # type: ignore[arg-type]
        )
        reply = io_struct.PauseGenerationReqOutput(  # every data-parallel replica's counts together
            num_aborted=sum(r.num_aborted for r in replies),
            num_retracted=sum(r.num_retracted for r in replies),
        )
        while mode == "abort" and not in_flight.isdisjoint(self._states):
            await asyncio.sleep(0.01)  # their final outputs are on the way (the detokenizer)
            self._check_alive()
        return reply

    # ------------------------------------------------------------------ operations
    async def _admit(self) -> None:
        """Wait while a weight update or a memory release holds admission closed."""
        if self.memory_released:
            raise ServiceUnavailableError(self._released_message())
        await self._admission.wait()
        if self.memory_released:
            raise ServiceUnavailableError(self._released_message())

    def _released_message(self) -> str:
        return (
            f"the server's memory is released ({sorted(self.memory_released)}); "
            "resume_memory_occupation first"
        )

    async def _drain(self, abort: bool) -> None:
        """Close admission (new requests wait) and wait until no request is in flight."""
        self._admission.clear()
        if abort and self._states:
            self.abort_request(abort_all=True)
        while self._states:
            await asyncio.sleep(0.01)
            self._check_alive()

    @contextlib.asynccontextmanager
    async def weights_exclusive(self, abort: bool) -> AsyncIterator[None]:
        """For a change of the weights: one at a time, admission paused, the requests in flight
        finished (or aborted) first; admission resumes after."""
        async with self._exclusive:
            try:
                await self._drain(abort)
                yield
            finally:
                self._admission.set()

    async def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, abort_all_requests: bool = False
    ) -> str:
        """Swap in the weights at ``model_path``: admission pauses, running requests finish (or
        are aborted), the weights change, the cache is flushed, admission resumes. A refusal
        (bad path, other shapes) raises ``ValueError`` and the old weights keep serving."""
        async with self._exclusive:
            try:
                await self._drain(abort_all_requests)
                reply = await self.control.call(
                    io_struct.UpdateWeightFromDiskReqInput(
                        model_path=model_path, load_format=load_format
                    )
                )
            finally:
                self._admission.set()
        return reply.message

    async def release_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Free the KV pool and/or the weights; requests get ``ServiceUnavailableError`` until
        ``resume_memory_occupation``. Running requests finish first."""
        async with self._exclusive:
            try:
                await self._drain(abort=False)
                release = io_struct.ReleaseMemoryOccupationReqInput(tags=tags)
                reply = await self.control.call(release)
                self.memory_released |= set(tags or ("kv_cache", "weights"))
            finally:
                self._admission.set()
        return reply.message

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> str:
        async with self._exclusive:
            reply = await self.control.call(io_struct.ResumeMemoryOccupationReqInput(tags=tags))
            self.memory_released -= set(tags or ("kv_cache", "weights"))
        return reply.message

