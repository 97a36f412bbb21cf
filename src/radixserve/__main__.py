"""``python -m radixserve serve ...`` (same as the ``radixserve`` command)."""

import sys

from radixserve.cli import main

# Guarded: the spawned children re-import the main module and must not start a server.
if __name__ == "__main__":
    sys.exit(main())
