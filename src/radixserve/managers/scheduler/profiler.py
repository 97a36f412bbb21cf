"""``start_profile`` / ``stop_profile``: a torch.profiler session over scheduler steps.

The trace is a Chrome trace (JSON) that Perfetto (ui.perfetto.dev) or ``chrome://tracing`` opens.
With ``num_steps`` the session stops by itself after that many model steps, at the end of the
step that completes them, so that the trace is on disk before that step's outputs are sent on.

A session is bounded: at most ``MAX_PROFILE_STEPS`` steps. The trace is written on the
scheduler's thread (torch's profiler stops and exports where it started), so its size is a pause
every request sees; an open-ended session (no ``num_steps``) that reaches the bound stops by
itself like one that asked for it, and the next ``stop_profile`` returns the trace it wrote.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch.profiler import ProfilerActivity

from radixserve.managers.io_struct import MAX_PROFILE_STEPS

logger = logging.getLogger(__name__)

_ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}


class StepProfiler:
    """At most one profiling session at a time; ``ValueError`` explains a refused call."""

    def __init__(self, default_dir: str) -> None:
        self.default_dir = default_dir
        self._profile: torch.profiler.profile | None = None
        self._path = ""
        self._steps_left = 0
        self._open_ended = False
        self._stopped_by_bound = ""  # the trace an open-ended session wrote at the bound

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(
        self,
        output_dir: str | None,
        num_steps: int | None,
        activities: list[str] | None,
        record_shapes: bool,
        with_stack: bool,
    ) -> str:
        """Begin recording; returns the path the trace will be written to."""
        if self._profile is not None:
            raise ValueError("a profile is already being recorded; stop it first")
        if num_steps is not None and not 0 < num_steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"num_steps must be in [1, {MAX_PROFILE_STEPS}], got {num_steps}")
        names = activities or (["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"])
        unknown = sorted(set(names) - set(_ACTIVITIES))
        if unknown:
            raise ValueError(f"unknown activities {unknown}; choose from {sorted(_ACTIVITIES)}")
        if "GPU" in names and not torch.cuda.is_available():
            raise ValueError("the GPU activity needs a CUDA device")
        directory = output_dir or self.default_dir
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, f"radixserve-{time.time():.6f}-TP-0.trace.json")
        self._profile = torch.profiler.profile(
            activities=[_ACTIVITIES[n] for n in names],
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
        self._profile.start()
        self._steps_left = num_steps or MAX_PROFILE_STEPS
        self._open_ended = num_steps is None
        self._stopped_by_bound = ""
        logger.info("profiling started (%s); the trace goes to %s", names, self._path)
        return self._path

    def stop(self) -> str:
        """Stop recording and write the trace; returns its path (an open-ended session's that
        stopped at the bound, once)."""
        if self._profile is None:
            path, self._stopped_by_bound = self._stopped_by_bound, ""
            if path:
                return path
            raise ValueError("no profile is being recorded")
        profile, self._profile = self._profile, None
        profile.stop()
        profile.export_chrome_trace(self._path)
        logger.info("profile written to %s", self._path)
        return self._path

    def on_step(self) -> None:
        """Count a model step; stops the session once its ``num_steps`` (or the bound) ran."""
        if self._profile is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            path = self.stop()
            if self._open_ended:
                logger.warning("profiling stopped by itself after %d steps (the bound); "
                               "stop_profile returns %s", MAX_PROFILE_STEPS, path)
                self._stopped_by_bound = path
