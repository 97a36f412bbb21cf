"""``start_profile`` / ``stop_profile``: a torch.profiler session over scheduler steps.

The trace is a Chrome trace (JSON) that Perfetto (ui.perfetto.dev) or ``chrome://tracing`` opens.
With ``num_steps`` the session stops by itself after that many model steps, at the end of the
step that completes them, so that the trace is on disk before that step's outputs are sent on.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch.profiler import ProfilerActivity

logger = logging.getLogger(__name__)

_ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}


class StepProfiler:
    """At most one profiling session at a time; ``ValueError`` explains a refused call."""

    def __init__(self, default_dir: str) -> None:
        self.default_dir = default_dir
        self._profile: torch.profiler.profile | None = None
        self._path = ""
        self._steps_left: int | None = None

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
        if num_steps is not None and num_steps <= 0:
            raise ValueError(f"num_steps must be positive, got {num_steps}")
        names = activities or (["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"])
        unknown = sorted(set(names) - set(_ACTIVITIES))
        if unknown:
            raise ValueError(f"unknown activities {unknown}; choose from {sorted(_ACTIVITIES)}")
        if "GPU" in names and not torch.cuda.is_available():
            raise ValueError("the GPU activity needs a CUDA device")
        directory = output_dir or self.default_dir
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, f"radixserve-{time.time():.0f}-TP-0.trace.json")
        self._profile = torch.profiler.profile(
            activities=[_ACTIVITIES[n] for n in names],
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
        self._profile.start()
        self._steps_left = num_steps
        logger.info("profiling started (%s); the trace goes to %s", names, self._path)
        return self._path

    def stop(self) -> str:
        """Stop recording and write the trace; returns its path."""
        if self._profile is None:
            raise ValueError("no profile is being recorded")
        profile, self._profile = self._profile, None
        profile.stop()
        profile.export_chrome_trace(self._path)
        logger.info("profile written to %s", self._path)
        return self._path

    def on_step(self) -> None:
        """Count a model step; stops the session once its ``num_steps`` ran."""
        if self._profile is None or self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()
