"""How a spawned worker process (scheduler, detokenizer) ends.

A worker exits at once with code 0 on SIGTERM (it holds nothing to flush: interpreter teardown
would only cost seconds), and exits the same way when its parent dies, so it never outlives the
server or Engine that started it (the watch thread exits the process itself: a main thread
blocked in a collective of torch.distributed would never run a signal handler).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

_PARENT_POLL_S = 0.5


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    os._exit(0)


def _exit_when_parent_dies() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # reparented once the parent is gone
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def install_exit_handlers() -> None:
    """Call first thing in a worker process."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _exit_when_parent_dies()
