"""The child side of a launch: what every spawned process (a scheduler rank, the detokenizer,
the data-parallel controller) calls to report to its parent and to end with it.

The entry point calls ``install_exit_handlers`` first, builds its component, then reports with
``report_ready(conn, info)`` or, on a failure, ``report_failure(conn, error)``; the parent
(``managers/launcher.py``) raises the child's error, or its exit code when it died without a word.

How a child ends: it exits at once with code 0 on SIGTERM (it holds nothing to flush:
interpreter teardown would only cost seconds), and exits the same way when its parent dies, so
it never outlives the server or Engine that started it. The watch thread exits the process
itself: a main thread blocked in a collective of torch.distributed would never run a signal
handler. A child that does hold something to flush (a scheduler with a session store) replaces
the SIGTERM handler with ``on_sigterm``: it finishes its step, flushes, then exits; when its
parent dies the watch thread SIGTERMs it and exits the process only if the flush has not ended
it within ``_FLUSH_GRACE_S``.
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

_PARENT_POLL_S = 0.5
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
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(_FLUSH_GRACE_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def install_exit_handlers() -> None:
    """Call first thing in a worker process."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _exit_when_parent_dies()


def on_sigterm(callback: Callable[[], None]) -> None:
    """From now on SIGTERM (also the one sent when the parent dies) calls ``callback`` on the
    main thread instead of exiting; the worker exits when it is done."""
    global _flushes_on_sigterm
    _flushes_on_sigterm = True
    signal.signal(signal.SIGTERM, lambda signum, frame: callback())


def report_ready(conn: Connection, info: dict[str, Any] | None = None) -> None:
    """Tell the parent this child is ready (``info``: what the parent may read of it)."""
    conn.send_bytes(json.dumps({**(info or {}), "status": "ready"}).encode())
    conn.close()


def report_failure(conn: Connection, error: BaseException) -> None:
    """Tell the parent this child failed to start, and why."""
    message = {"status": "error", "message": f"{type(error).__name__}: {error}"}
    conn.send_bytes(json.dumps(message).encode())
