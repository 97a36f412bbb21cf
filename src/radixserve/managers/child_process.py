"""The child side of a launch: what every spawned process (a scheduler rank, the detokenizer,
the data-parallel controller) calls to report to its parent and to end with it.

The entry point calls ``install_exit_handlers`` first, builds its component, then reports with
``report_ready(conn, info)`` or, on a failure, ``report_failure(conn, error)``; the parent
(``managers/launcher.py``) raises the child's error, or its exit code when it died without a word.

How a child ends: only its parent ends it, with ``STOP_SIGNAL`` (SIGUSR1, sent by the
launcher's ``terminate_processes``), or by dying. The child ignores SIGINT and SIGTERM: a
terminal's Ctrl-C and a supervisor's SIGTERM to the whole process group (systemd's default) reach
the parent too, which drains its requests and then stops its children; a child that exited on the
group's signal would look like a crash to the parent. On ``STOP_SIGNAL`` a child exits at once
with code 0 (it holds nothing to flush: interpreter teardown would only cost seconds), and exits
the same way when its parent dies, so it never outlives the server or Engine that started it. The
watch thread exits the process itself: a main thread blocked in a collective of
torch.distributed would never run a signal handler. A child that does hold something to flush (a
scheduler with a session store) replaces the handler with ``on_sigterm``: it finishes its step,
flushes, then exits; when its parent dies the watch thread signals it and exits the process only
if the flush has not ended it within ``_FLUSH_GRACE_S``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from radixserve import startup_gc

_PARENT_POLL_S = 0.5
# How a parent stops its children (they ignore the process group's SIGINT and SIGTERM).
STOP_SIGNAL = signal.SIGUSR1
_FLUSH_GRACE_S = 180.0  # the session store's flush on SIGTERM takes up to 120 s
_flushes_on_sigterm = False


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    os._exit(0)


def _exit_when_parent_dies() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # reparented once the parent is gone
            time.sleep(_PARENT_POLL_S)
        if _flushes_on_sigterm:
            os.kill(os.getpid(), STOP_SIGNAL)
            time.sleep(_FLUSH_GRACE_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def install_exit_handlers() -> None:
    """Call first thing in a worker process."""
    signal.signal(STOP_SIGNAL, _exit_on_sigterm)
    _exit_when_parent_dies()


def on_sigterm(callback: Callable[[], None]) -> None:
    """From now on ``STOP_SIGNAL`` (also the one sent when the parent dies) calls ``callback``
    on the main thread instead of exiting; the worker exits when it is done."""
    global _flushes_on_sigterm
    _flushes_on_sigterm = True
    signal.signal(STOP_SIGNAL, lambda signum, frame: callback())


def report_ready(conn: Connection, info: dict[str, Any] | None = None) -> None:
    """Tell the parent this child is ready (``info``: what the parent may read of it), and
    collect garbage again, with the start-up heap frozen (``startup_gc``)."""
    startup_gc.freeze_and_resume()
    conn.send_bytes(json.dumps({**(info or {}), "status": "ready"}).encode())
    conn.close()


def report_failure(conn: Connection, error: BaseException) -> None:
    """Tell the parent this child failed to start, and why."""
    message = {"status": "error", "message": f"{type(error).__name__}: {error}"}
    conn.send_bytes(json.dumps(message).encode())
