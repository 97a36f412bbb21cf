"""How a spawned worker process (scheduler, detokenizer) ends.

A worker exits at once with code 0 on SIGTERM (it holds nothing to flush: interpreter teardown
would only cost seconds), and SIGTERMs itself when its parent dies, so it never outlives the
server or Engine that started it. A worker that does hold something to flush (a scheduler with a
session store) replaces that with ``on_sigterm``: it finishes its step, flushes, then exits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

_PARENT_POLL_S = 0.5


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    os._exit(0)


def _exit_when_parent_dies() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # reparented once the parent is gone
            time.sleep(_PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def install_exit_handlers() -> None:
    """Call first thing in a worker process."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _exit_when_parent_dies()


def on_sigterm(callback: Callable[[], None]) -> None:
    """From now on SIGTERM (also the one sent when the parent dies) calls ``callback`` on the
    main thread instead of exiting; the worker exits when it is done."""
    signal.signal(signal.SIGTERM, lambda signum, frame: callback())
