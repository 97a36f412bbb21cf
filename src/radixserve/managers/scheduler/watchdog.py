"""The scheduler's watchdog: a step that does not return within ``--watchdog-timeout`` is a hang.

A daemon thread watches the step the loop marks with ``step_started``/``step_finished``. When one
has run too long it writes every thread's stack to stderr (the log) and ends the scheduler
process with ``EXIT_CODE``; the server sees its child die, turns ``/health`` to 503, stops the
other children and exits non-zero. A hung step cannot be interrupted from Python, so ending the
process is the only way to free the device and let a supervisor restart the server.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)

EXIT_CODE = 70  # EX_SOFTWARE


class Watchdog:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._started: float | None = None
        self._thread = threading.Thread(target=self._watch, name="scheduler-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_finished(self) -> None:
        self._started = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while True:
            time.sleep(poll)
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout:
                self._fire(time.monotonic() - started)

    def _fire(self, elapsed: float) -> None:
        logger.error(
            "watchdog: a scheduler step has run for %.1fs (--watchdog-timeout %.1fs); dumping "
            "every thread's stack and exiting", elapsed, self.timeout,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.write("Scheduler watchdog timeout: stacks of every thread follow\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_CODE)
