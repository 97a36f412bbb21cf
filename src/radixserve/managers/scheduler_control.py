"""The scheduler's control requests: weights, memory, profiling, knobs, load, health, inspector.

``SchedulerControl`` is composed into the ``Scheduler`` (never mixed in): it owns the state
these requests add (the profiler, the forward sleep, which memory is released) and reaches the
scheduler only through the narrow surface below. Every handler returns its ``*Output`` reply.

    scheduler.finish_step_in_flight()   process the overlap step in flight, if any
    scheduler.is_idle()            nothing runs, waits or is in flight
    scheduler.flush()              drop the prefix cache and every slot (idle only)
    scheduler.memory_state()       KV and request-slot figures
    scheduler.num_running(), scheduler.num_waiting(), scheduler.waiting_queue,
    scheduler.running_batch
    scheduler.max_running_requests, scheduler.settings   the knobs set_internal_state changes
    scheduler.tp_worker.model_runner   weights and KV pool
    scheduler.tree_cache, scheduler.sessions, scheduler.stats   for the inspector
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import tempfile
import time
from typing import TYPE_CHECKING, Any

from radixserve import envs
from radixserve.managers.io_struct import (
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
from radixserve.managers.profiler import StepProfiler
from radixserve.managers.scheduler_stats import token_usage
from radixserve.model_executor.model_runner import MEMORY_TAGS

if TYPE_CHECKING:
    from radixserve.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

# set_internal_state: the knobs that may change while serving, each with its lower bound.
TUNABLE = {"max_running_requests": 1, "max_prefill_tokens": 1, "chunked_prefill_size": 1}
_INSPECT_MAX_NODES = 256
_INSPECT_MAX_REQS = 64
_SLEEP_SLICE_S = 0.1  # slow_down sleeps in slices this long, checking for a reset or a stop


class SchedulerControl:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.profiler = StepProfiler(envs.RADIXSERVE_TORCH_PROFILER_DIR.get(tempfile.gettempdir()))
        self.forward_sleep_time: float | None = None

    def handlers(self) -> list[tuple[type, Any]]:
        """``(message type, handler)`` pairs for the scheduler's dispatcher."""
        return [
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
        s = self.scheduler
        s.finish_step_in_flight()
        if s.is_idle():
            return None
        return (
            f"requests are running or waiting ({s.num_running()} running, "
            f"{s.num_waiting()} waiting)"
        )

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
                    f" the next {msg.num_steps} steps" if msg.num_steps else " until stop_profile"
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
        s = self.scheduler
        changes = dict(msg.server_args)
        error = None
        unknown = sorted(set(changes) - set(TUNABLE))
        if unknown or not changes:
            error = f"settable keys are {sorted(TUNABLE)}; got {sorted(changes)}"
        for key, value in changes.items():
            if error is None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < TUNABLE[key]):
                error = f"{key} must be an integer >= {TUNABLE[key]}, got {value!r}"
        rows = s.req_to_token_pool.size
        if error is None and changes.get("max_running_requests", 0) > rows:
            error = f"max_running_requests cannot exceed the {rows} request slots allocated"
        if error is None and changes.get("chunked_prefill_size", s.page_size) < s.page_size:
            error = f"chunked_prefill_size must be at least page_size ({s.page_size})"
        if error is None:
            if "max_running_requests" in changes:
                s.max_running_requests = changes.pop("max_running_requests")
            s.settings = dataclasses.replace(s.settings, **changes)
            logger.info("internal state set: %s", msg.server_args)
        current = {
            "max_running_requests": s.max_running_requests,
            "max_prefill_tokens": s.settings.max_prefill_tokens,
            "chunked_prefill_size": s.settings.chunked_prefill_size,
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
        s = self.scheduler
        used, usage = token_usage(s.memory_state())
        running, waiting = s.num_running(), s.num_waiting()
        return GetLoadReqOutput(
            dp_rank=s.dp_rank, num_reqs=running + waiting, num_running_reqs=running,
            num_waiting_reqs=waiting, num_tokens=used,
            max_total_num_tokens=s.max_total_num_tokens, token_usage=usage,
        )

    def health_check(self, msg: HealthCheckReq) -> HealthCheckReqOutput:
        return HealthCheckReqOutput(seq=msg.seq)

    def inspect(self, msg: GetInspectorStateReq) -> GetInspectorStateReqOutput:
        s = self.scheduler

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
            for sid, sess in list(s.sessions.sessions.items())[:_INSPECT_MAX_REQS]
        ]
        state = {
            "time": time.time(),
            "memory": s.memory_state(),
            "num_running_reqs": s.num_running(),
            "num_waiting_reqs": s.num_waiting(),
            "running": [describe(r) for r in s.running_batch.reqs[:_INSPECT_MAX_REQS]],
            "waiting": [describe(r) for r in s.waiting_queue[:_INSPECT_MAX_REQS]],
            "radix_tree": s.tree_cache.snapshot(_INSPECT_MAX_NODES),
            "sessions": sessions,
            "history": list(s.stats.history),
            "stats": s.stats.summary(),
            "released_memory": sorted(self.released),
            "profiling": self.profiler.active,
            "forward_sleep_time": self.forward_sleep_time,
        }
        return GetInspectorStateReqOutput(state=state)
