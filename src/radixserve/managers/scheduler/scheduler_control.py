"""The scheduler's control requests: cache flush, pause, weights, memory, profiling, knobs, load,
health, inspector.

``SchedulerControl`` is composed into the ``Scheduler`` (never mixed in): it owns the state
these requests add (the profiler, the forward sleep) and reaches the scheduler only through
``ControlledScheduler``, the narrow surface below (this module never imports the scheduler).
Every handler returns its ``*Output`` reply. The client side of these requests is
``managers/tokenizer/control_client.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import tempfile
import time
from typing import TYPE_CHECKING, Any, Protocol

from radixserve import envs
from radixserve.managers.io_struct import (
    MAX_PROFILE_STEPS,
    AbortReq,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    FreezeGCReq,
    FreezeGCReqOutput,
    GetInspectorStateReq,
    GetInspectorStateReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    HealthCheckReq,
    HealthCheckReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ProfileReq,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    SetInternalStateReq,
    SetInternalStateReqOutput,
    SlowDownReqInput,
    SlowDownReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)
from radixserve.managers.scheduler.profiler import StepProfiler
from radixserve.managers.scheduler.scheduler_stats import token_usage
from radixserve.model_executor.model_runner import MEMORY_TAGS

if TYPE_CHECKING:
    from radixserve.managers.scheduler.request_receiver import RequestReceiver
    from radixserve.managers.scheduler.schedule_batch import Req, ScheduleBatch
    from radixserve.managers.scheduler.scheduler_parts import SchedulerSettings
    from radixserve.managers.scheduler.scheduler_stats import SchedulerStats
    from radixserve.managers.scheduler.session_controller import SessionController
    from radixserve.managers.scheduler.tp_worker import TpModelWorker
    from radixserve.mem_cache import BasePrefixCache
    from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool

logger = logging.getLogger(__name__)

# set_internal_state: the knobs that may change while serving, each with its lower bound.
TUNABLE = {"max_running_requests": 1, "max_prefill_tokens": 1, "chunked_prefill_size": 1}
_INSPECT_MAX_NODES = 256
_INSPECT_MAX_REQS = 64
_SLEEP_SLICE_S = 0.1  # slow_down sleeps in slices this long, checking for a reset or a stop


class ControlledScheduler(Protocol):
    """What the control requests reach of the ``Scheduler`` (each method's doc is there)."""

    tp_worker: TpModelWorker  # its model runner: weights and memory
    req_to_token_pool: ReqToTokenPool
    tree_cache: BasePrefixCache
    sessions: SessionController
    stats: SchedulerStats
    page_size: int
    max_total_num_tokens: int
    dp_rank: int
    waiting_queue: list[Req]
    num_aborted_reqs: int
    # What the control requests change: the knobs of set_internal_state, the pause.
    max_running_requests: int
    settings: SchedulerSettings
    paused: bool
    stop_requested: bool
    receiver: RequestReceiver | None  # a slowed-down step sleeps on it

    @property
    def running_batch(self) -> ScheduleBatch: ...

    def finish_step_in_flight(self) -> None: ...
    def is_idle(self) -> bool: ...
    def flush(self) -> None: ...
    def memory_state(self) -> dict[str, int]: ...
    def num_running(self) -> int: ...
    def num_waiting(self) -> int: ...
    def handle_abort(self, msg: AbortReq) -> None: ...
    def finish_aborted(self) -> None: ...
    def retract_all(self) -> int: ...


class SchedulerControl:
    def __init__(self, scheduler: ControlledScheduler) -> None:
        self.scheduler = scheduler
        self.profiler = StepProfiler(envs.RADIXSERVE_TORCH_PROFILER_DIR.get(tempfile.gettempdir()))
        self.forward_sleep_time: float | None = None

    def handlers(self) -> list[tuple[type, Any]]:
        """``(message type, handler)`` pairs for the scheduler's dispatcher."""
        return [
            (FlushCacheReq, self.flush_cache),
            (PauseGenerationReqInput, self.pause_generation),
            (ContinueGenerationReqInput, self.continue_generation),
            (UpdateWeightFromDiskReqInput, self.update_weights_from_disk),
            (GetWeightsByNameReqInput, self.get_weights_by_name),
            (ReleaseMemoryOccupationReqInput, self.release_memory_occupation),
            (ResumeMemoryOccupationReqInput, self.resume_memory_occupation),
            (ProfileReq, self.profile),
            (SetInternalStateReq, self.set_internal_state),
            (SlowDownReqInput, self.slow_down),
            (FreezeGCReq, self.freeze_gc),
            (GetLoadReqInput, self.get_load),
            (HealthCheckReq, self.health_check),
            (GetInspectorStateReq, self.inspect),
        ]

    @property
    def released(self) -> set[str]:
        return self.scheduler.tp_worker.model_runner.released

    def released_message(self) -> str:
        """Why a new request is refused (503) while memory is released."""
        return (
            f"the server's memory is released ({sorted(self.released)}): "
            "resume_memory_occupation first"
        )

    def after_step(self) -> None:
        """Called after every model step: the profiler counts it, ``slow_down`` sleeps (inside
        the step as the watchdog sees it)."""
        self.profiler.on_step()
        if self.forward_sleep_time:
            self._sleep(self.forward_sleep_time)

    def _sleep(self, seconds: float) -> None:
        """``slow_down``'s sleep, in slices: a new ``slow_down`` (a reset, say) or a stop
        (SIGTERM) ends it early, so that the hook is never stuck. The value is bounded by
        ``--watchdog-timeout`` (``TokenizerManager.slow_down``)."""
        deadline = time.monotonic() + seconds
        receiver = self.scheduler.receiver
        while not self.scheduler.stop_requested:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if receiver is None:
                time.sleep(min(left, _SLEEP_SLICE_S))
            elif receiver.wait_for(SlowDownReqInput, min(left, _SLEEP_SLICE_S)):
                return

    def _busy(self) -> str | None:
        """Why the scheduler is not idle once the step in flight finished, or None."""
        scheduler = self.scheduler
        scheduler.finish_step_in_flight()
        if scheduler.is_idle():
            return None
        return (
            f"requests are running or waiting ({scheduler.num_running()} running, "
            f"{scheduler.num_waiting()} waiting)"
        )

    # ------------------------------------------------------------------ cache, pause
    def flush_cache(self, msg: FlushCacheReq) -> FlushCacheReqOutput:
        scheduler = self.scheduler
        scheduler.finish_step_in_flight()
        if not scheduler.is_idle():
            return FlushCacheReqOutput(
                success=False,
                message=(
                    f"cannot flush the cache while requests run or wait "
                    f"({scheduler.num_running()} running, {scheduler.num_waiting()} waiting)"
                ),
            )
        scheduler.flush()
        return FlushCacheReqOutput(success=True)

    def pause_generation(self, msg: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        """Stop running batches (see ``PauseGenerationReqInput`` for the modes).

        The step in flight (overlap loop) is finished and its tokens processed first, so the
        reply means: nothing computes until ``continue_generation``. Aborts arriving while
        paused take effect at once, as no step will come to finish the marked requests.
        Pausing a paused scheduler applies the new mode to what is there.
        """
        scheduler = self.scheduler
        scheduler.paused = True
        scheduler.finish_step_in_flight()
        aborted_before = scheduler.num_aborted_reqs
        scheduler.finish_aborted()
        retracted = 0
        if msg.mode == "abort":
            scheduler.handle_abort(AbortReq(abort_all=True))
        elif msg.mode == "retract":
            retracted = scheduler.retract_all()
        aborted = scheduler.num_aborted_reqs - aborted_before
        logger.info("generation paused (%s): %d request(s) aborted, %d retracted",
                    msg.mode, aborted, retracted)
        return PauseGenerationReqOutput(num_aborted=aborted, num_retracted=retracted)

    def continue_generation(
        self, msg: ContinueGenerationReqInput
    ) -> ContinueGenerationReqOutput:
        if self.scheduler.paused:
            logger.info("generation continued")
        self.scheduler.paused = False
        return ContinueGenerationReqOutput()

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(
        self, msg: UpdateWeightFromDiskReqInput
    ) -> UpdateWeightFromDiskReqOutput:
        busy = self._busy()
        if busy is not None:
            return UpdateWeightFromDiskReqOutput(success=False, message=f"cannot update: {busy}")
        if self.released:
            return UpdateWeightFromDiskReqOutput(
                success=False, message=f"resume the released memory first ({sorted(self.released)})"
            )
        try:
            self.scheduler.tp_worker.model_runner.update_weights_from_disk(
                msg.model_path, msg.load_format
            )
        except (ValueError, OSError) as e:
            logger.warning("weight update from %s refused: %s", msg.model_path, e)
            return UpdateWeightFromDiskReqOutput(success=False, message=str(e))
        self.scheduler.flush()  # cached KV was computed by the old weights
        return UpdateWeightFromDiskReqOutput(
            success=True, message=f"weights updated from {msg.model_path}; cache flushed"
        )

    def get_weights_by_name(self, msg: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        if msg.truncate_size <= 0:
            return GetWeightsByNameReqOutput(
                parameter=None, message=f"truncate_size must be positive, got {msg.truncate_size}"
            )
        try:
            values = self.scheduler.tp_worker.model_runner.get_weights_by_name(
                msg.name, msg.truncate_size
            )
        except ValueError as e:
            return GetWeightsByNameReqOutput(parameter=None, message=str(e))
        return GetWeightsByNameReqOutput(parameter=values)

    # ------------------------------------------------------------------ memory
    def _tags(self, tags: list[str] | None) -> set[str]:
        chosen = set(tags) if tags is not None else set(MEMORY_TAGS)
        unknown = sorted(chosen - set(MEMORY_TAGS))
        if unknown or not chosen:
            raise ValueError(f"tags must be a non-empty subset of {list(MEMORY_TAGS)}, got {tags}")
        return chosen

    def release_memory_occupation(
        self, msg: ReleaseMemoryOccupationReqInput
    ) -> ReleaseMemoryOccupationReqOutput:
        try:
            tags = self._tags(msg.tags)
        except ValueError as e:
            return ReleaseMemoryOccupationReqOutput(success=False, message=str(e))
        busy = self._busy()
        if busy is not None:
            return ReleaseMemoryOccupationReqOutput(
                success=False, message=f"cannot release: {busy}"
            )
        self.scheduler.flush()
        self.scheduler.tp_worker.model_runner.release_memory(tags)
        logger.info("released memory: %s", sorted(tags))
        return ReleaseMemoryOccupationReqOutput(success=True, message=f"released {sorted(tags)}")

    def resume_memory_occupation(
        self, msg: ResumeMemoryOccupationReqInput
    ) -> ResumeMemoryOccupationReqOutput:
        try:
            tags = self._tags(msg.tags)
            self.scheduler.tp_worker.model_runner.resume_memory(tags)
        except (ValueError, OSError) as e:
            return ResumeMemoryOccupationReqOutput(success=False, message=str(e))
        logger.info("resumed memory: %s", sorted(tags))
        still = sorted(self.released)
        message = f"resumed {sorted(tags)}" + (f"; still released: {still}" if still else "")
        return ResumeMemoryOccupationReqOutput(success=True, message=message)

    # ------------------------------------------------------------------ profiling
    def profile(self, msg: ProfileReq) -> ProfileReqOutput:
        try:
            if msg.action == "start":
                path = self.profiler.start(
                    msg.output_dir, msg.num_steps, msg.activities, msg.record_shapes,
                    msg.with_stack,
                )
                message = "profiling" + (
                    f" the next {msg.num_steps} steps" if msg.num_steps
                    else f" until stop_profile (at most {MAX_PROFILE_STEPS} steps)"
                )
            elif msg.action == "stop":
                path, message = self.profiler.stop(), "profile written"
            else:
                raise ValueError(f"unknown profile action {msg.action!r}")
        except (ValueError, OSError) as e:
            return ProfileReqOutput(success=False, message=str(e))
        return ProfileReqOutput(success=True, message=message, trace_path=path)

    # ------------------------------------------------------------------ knobs
    def set_internal_state(self, msg: SetInternalStateReq) -> SetInternalStateReqOutput:
        scheduler = self.scheduler
        changes = dict(msg.server_args)
        error = None
        unknown = sorted(set(changes) - set(TUNABLE))
        if unknown or not changes:
            error = f"settable keys are {sorted(TUNABLE)}; got {sorted(changes)}"
        for key, value in changes.items():
            if error is None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < TUNABLE[key]):
                error = f"{key} must be an integer >= {TUNABLE[key]}, got {value!r}"
        rows = scheduler.req_to_token_pool.size
        if error is None and changes.get("max_running_requests", 0) > rows:
            error = f"max_running_requests cannot exceed the {rows} request slots allocated"
        page_size = scheduler.page_size
        if error is None and changes.get("chunked_prefill_size", page_size) < page_size:
            error = f"chunked_prefill_size must be at least page_size ({page_size})"
        if error is None:
            if "max_running_requests" in changes:
                scheduler.max_running_requests = changes.pop("max_running_requests")
            scheduler.settings = dataclasses.replace(scheduler.settings, **changes)
            logger.info("internal state set: %s", msg.server_args)
        current = {
            "max_running_requests": scheduler.max_running_requests,
            "max_prefill_tokens": scheduler.settings.max_prefill_tokens,
            "chunked_prefill_size": scheduler.settings.chunked_prefill_size,
        }
        return SetInternalStateReqOutput(
            updated=error is None, message=error or "updated", server_args=current
        )

    def slow_down(self, msg: SlowDownReqInput) -> SlowDownReqOutput:
        """A test hook, as in SGLang: every following forward step sleeps this long."""
        self.forward_sleep_time = msg.forward_sleep_time or None
        return SlowDownReqOutput(forward_sleep_time=self.forward_sleep_time)

    def freeze_gc(self, msg: FreezeGCReq) -> FreezeGCReqOutput:
        """Move every object alive now to the permanent generation: fewer, shorter collections
        once the server is warm (the scheduler's many long-lived tensors and requests)."""
        gc.collect()
        gc.freeze()
        return FreezeGCReqOutput(frozen_objects=gc.get_freeze_count())

    # ------------------------------------------------------------------ load, health, inspector
    def get_load(self, msg: GetLoadReqInput) -> GetLoadReqOutput:
        scheduler = self.scheduler
        used, usage = token_usage(scheduler.memory_state())
        running, waiting = scheduler.num_running(), scheduler.num_waiting()
        return GetLoadReqOutput(
            dp_rank=scheduler.dp_rank, num_reqs=running + waiting, num_running_reqs=running,
            num_waiting_reqs=waiting, num_tokens=used,
            max_total_num_tokens=scheduler.max_total_num_tokens, token_usage=usage,
        )

    def health_check(self, msg: HealthCheckReq) -> HealthCheckReqOutput:
        return HealthCheckReqOutput(seq=msg.seq)

    def inspect(self, msg: GetInspectorStateReq) -> GetInspectorStateReqOutput:
        scheduler = self.scheduler

        def describe(req: Any) -> dict[str, Any]:
            return {
                "rid": req.rid,
                "prompt_tokens": len(req.origin_input_ids),
                "output_tokens": len(req.output_ids),
                "kv_len": req.kv_len,
                "cached_tokens": req.cached_tokens,
            }

        sessions = [
            {"id": sid, "streaming": sess.streaming, "num_reqs": len(sess.req_nodes),
             "inflight": getattr(sess, "inflight_rid", None)}
            for sid, sess in list(scheduler.sessions.sessions.items())[:_INSPECT_MAX_REQS]
        ]
        state = {
            "time": time.time(),
            "memory": scheduler.memory_state(),
            "num_running_reqs": scheduler.num_running(),
            "num_waiting_reqs": scheduler.num_waiting(),
            "running": [describe(r) for r in scheduler.running_batch.reqs[:_INSPECT_MAX_REQS]],
            "waiting": [describe(r) for r in scheduler.waiting_queue[:_INSPECT_MAX_REQS]],
            "radix_tree": scheduler.tree_cache.snapshot(_INSPECT_MAX_NODES),
            "sessions": sessions,
            "history": list(scheduler.stats.history),
            "stats": scheduler.stats.summary(),
            "released_memory": sorted(self.released),
            "profiling": self.profiler.active,
            "forward_sleep_time": self.forward_sleep_time,
        }
        return GetInspectorStateReqOutput(state=state)
