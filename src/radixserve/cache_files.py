"""What radixserve's on-disk caches share (the compiled CPU kernels, the kernel timings, the
GGUF metadata): a lock that makes the other processes wait while one builds an entry, and a
digest of the source files an entry was built from, so that changed code never reads an entry
the old code wrote."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path


def source_digest(*files: Path) -> str:
    """A digest of these files' bytes, in the order given (16 hex digits)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Held against every other process that takes ``lock_file``: an ``fcntl`` lock, which the
    kernel drops when its holder dies, so a builder killed half-way never blocks the next one.
    Raises ``OSError`` when the file cannot be created (a read-only cache)."""
    with open(lock_file, "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)
