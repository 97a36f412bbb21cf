"""``RADIXSERVE_EXIT_WITH_PARENT=1``: a ``radixserve serve`` that stops when its parent dies.

A server started by a program (a test run, a notebook, a supervisor script) that is killed
without a chance to clean up (SIGKILL, an out-of-memory kill) would otherwise serve on, holding
its port, memory and worker processes: an orphan of a killed test run was still up an hour later.
With the variable set, a watch thread polls the parent's pid and, once the server has been
reparented (the parent is gone), sends the server SIGTERM: the usual drain and clean stop
(``http_server.py``), whose exit stops the worker processes too. If that stop has not ended the
process within ``_STOP_GRACE_S``, the thread exits it (the workers then see their parent gone).

Polling rather than Linux's ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the
*thread* that started the server ends, not its process (a server started from a worker thread
would be stopped with that thread), and only on Linux; a poll of ``getppid()`` twice a second
sees the parent process itself, on any POSIX system. The worker processes watch the server the
same way (``managers/child_process.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from radixserve import envs

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5
# Well past the drain (5 s) and the workers' stop (a session store flushes for up to 120 s).
_STOP_GRACE_S = 300.0


def stop_when_parent_dies() -> bool:
    """Start the watch thread when ``RADIXSERVE_EXIT_WITH_PARENT`` is set; return whether."""
    if not envs.RADIXSERVE_EXIT_WITH_PARENT.get():
        return False
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # reparented once the parent is gone
            time.sleep(_PARENT_POLL_S)
        logger.warning("the parent process %d is gone: stopping (RADIXSERVE_EXIT_WITH_PARENT)",
                       parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_STOP_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True
