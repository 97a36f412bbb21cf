"""``python -m radixserve serve ...`` (same as the ``radixserve`` command)."""

import sys

from radixserve import startup_gc

# First thing, in the server and in each child it spawns (they re-import this module): no
# garbage collection while torch and the server stack load; each process resumes it once ready.
startup_gc.pause()

from radixserve.cli import main  # noqa: E402

# Guarded: the spawned children re-import the main module and must not start a server.
if __name__ == "__main__":
    sys.exit(main())
