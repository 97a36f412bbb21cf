"""Where an idle streaming session's KV goes instead of being dropped: the session store.

``SessionAwareCache`` offloads a session's slot here when the pool runs short or the session has
been idle for ``--session-offload-after`` seconds, and loads it back (one copy into freshly
allocated KV slots, no recompute) when the session's next turn comes. Two tiers:

- ``DiskSessionStore`` (``--session-store DIR``): a file per session, written at offload and at
  shutdown, so that sessions survive a restart (``open_session`` with ``"resume": true``);
- ``HostSessionStore``: host memory (pinned, for fast copies) when the pool is on a GPU and no
  directory is given; it lives as long as the process.

Both are bounded (``--session-store-max-gb``): storing past the bound drops the least recently
used sessions first (their next turn re-prefills), and a session larger than the bound is not
stored at all.

A session is stored in the storage tier's file format and through its code
(``mem_cache/kv_file.py``, the same reader and writer as the hierarchical cache's blocks): one
file ``<digest of the id>.session`` of kind ``"session"``, whose header holds ``session_id``,
``history`` (what its next turn continues) and ``token_ids`` (the tokens whose KV the payload
holds: the session's slot, usually the history but its last token, more after a retracted turn);
the payload is their KV in the pool's ``read_kv_pages`` format, a quantized pool's scales
included, so it restores into a pool of any page size. The host store keeps the same bytes in
memory. A file whose fingerprint or KV layout differs from the running model's pool, or that is
shorter than its header says, is refused when the session resumes; a payload whose checksum fails
is refused when it is loaded. Refused KV is never used: the session re-prefills its history. A
file whose header cannot be read (not a KV file, another format version, a corrupt header)
cannot be resumed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.mem_cache.kv_file import (
    HEADER_BYTES,
    KVExpectation,
    KVFileError,
    load_kv_file,
    model_fingerprint,
    read_kv_header,
    write_kv_file,
)
from radixserve.mem_cache.kv_pool import MHATokenToKVPool

logger = logging.getLogger(__name__)

_SUFFIX = ".session"
_KIND = "session"


class SessionStoreError(LookupError):
    """A stored session that cannot be resumed (missing, or its header is unreadable)."""


@dataclass
class StoredSession:
    """A session the store holds: its history, and the tokens whose KV it holds."""

    session_id: str
    token_ids: list[int]
    kv_token_ids: list[int]
    nbytes: int
    last_used: float

    @property
    def kv_tokens(self) -> int:
        return len(self.kv_token_ids)


class SessionStore(ABC):
    """A bounded map session id → (history, KV of its first ``kv_tokens``), least recently used
    sessions dropped first. KV moves between the store and the pool's slots in the pool's tier
    format (``read_kv_pages`` / ``write_kv_pages``); the pool's allocator and request rows are
    the caller's business."""

    def __init__(self, pool: MHATokenToKVPool, expect: KVExpectation,
                 max_bytes: int | None) -> None:
        self.pool = pool
        self.expect = expect
        self.max_bytes = max_bytes
        self.entries: dict[str, StoredSession] = {}

    # ------------------------------------------------------------------ public
    @property
    def survives_restart(self) -> bool:
        return False

    def get(self, session_id: str) -> StoredSession | None:
        return self.entries.get(session_id)

    def save(
        self, session_id: str, token_ids: list[int], kv_token_ids: list[int],
        kv_indices: torch.Tensor,
    ) -> bool:
        """Store history ``token_ids`` and the KV of ``kv_token_ids`` (in pool slots
        ``kv_indices``), replacing what the session had. False when it does not fit the
        store's bound, or cannot be written (nothing is stored then)."""
        assert len(kv_indices) == len(kv_token_ids), "one pool slot per token"
        nbytes = self._size(len(token_ids) + len(kv_token_ids), len(kv_token_ids))
        self.discard(session_id)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            logger.info("session %r (%d bytes) exceeds the store's bound", session_id, nbytes)
            return False
        self._make_room(nbytes)
        data = self.pool.read_kv_pages(kv_indices)
        written = self._write(session_id, list(token_ids), list(kv_token_ids), data)
        if written is None:
            return False
        self.entries[session_id] = StoredSession(
            session_id, list(token_ids), list(kv_token_ids), written, time.monotonic()
        )
        return True

    def load(self, session_id: str, kv_indices: torch.Tensor) -> bool:
        """Copy the session's stored KV into pool slots ``kv_indices`` (one per stored token).
        False, with the session dropped from the store, when its payload is refused."""
        entry = self.entries[session_id]
        assert len(kv_indices) == entry.kv_tokens, "load into as many slots as tokens stored"
        data = self._read(session_id)
        if data is None:
            self.discard(session_id)
            return False
        self.pool.write_kv_pages(kv_indices, data)
        entry.last_used = time.monotonic()
        return True

    def discard(self, session_id: str) -> None:
        if self.entries.pop(session_id, None) is not None:
            self._remove(session_id)

    def open(self, session_id: str) -> StoredSession:
        """The stored session of an earlier run (``resume``); ``SessionStoreError`` if none."""
        entry = self.entries.get(session_id)
        if entry is None:
            raise SessionStoreError(f"no stored session {session_id!r}")
        return entry

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    # ------------------------------------------------------------------ helpers
    def _size(self, num_ids: int, kv_tokens: int) -> int:
        """Bytes a stored session takes: its KV, and its header (token ids estimated at 8
        bytes each) padded to whole ``HEADER_BYTES``."""
        header = -(-(8 * num_ids + 1024) // HEADER_BYTES) * HEADER_BYTES
        return kv_tokens * self.expect.bytes_per_token + header

    def _make_room(self, nbytes: int) -> None:
        if self.max_bytes is None:
            return
        for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
            if self.total_bytes() + nbytes <= self.max_bytes:
                return
            logger.info("session store full: dropping session %r", entry.session_id)
            self.discard(entry.session_id)

    @abstractmethod
    def _write(self, session_id: str, history: list[int], kv_token_ids: list[int],
               data: torch.Tensor) -> int | None:
        """Keep the session; return the bytes it takes, or None when it cannot be kept."""

    @abstractmethod
    def _read(self, session_id: str) -> torch.Tensor | None:
        """The KV ``_write`` kept (``[kv_tokens, bytes_per_token]`` uint8), or None when it is
        refused."""

    @abstractmethod
    def _remove(self, session_id: str) -> None:
        """Forget what ``_write`` kept."""


class HostSessionStore(SessionStore):
    """Sessions in host memory, pinned when the pool is on a GPU (fast device copies)."""

    def __init__(self, pool: MHATokenToKVPool, expect: KVExpectation,
                 max_bytes: int | None) -> None:
        super().__init__(pool, expect, max_bytes)
        self._payloads: dict[str, torch.Tensor] = {}
        self._pin = pool.device.type == "cuda"

    def _write(self, session_id: str, history: list[int], kv_token_ids: list[int],
               data: torch.Tensor) -> int:
        self._payloads[session_id] = data.pin_memory() if self._pin else data
        return self._size(len(history) + len(kv_token_ids), len(kv_token_ids))

    def _read(self, session_id: str) -> torch.Tensor | None:
        return self._payloads[session_id]

    def _remove(self, session_id: str) -> None:
        self._payloads.pop(session_id, None)


class DiskSessionStore(SessionStore):
    """A file per session under ``directory``, in the storage tier's format (module docstring).

    Files of earlier runs are indexed by name at start-up (they count against the bound, and
    the least recently modified go first); their headers are read when a session resumes.
    """

    def __init__(
        self, directory: str | Path, pool: MHATokenToKVPool, expect: KVExpectation,
        max_bytes: int | None,
    ) -> None:
        super().__init__(pool, expect, max_bytes)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Files of earlier runs not opened yet: file name -> (bytes, mtime).
        self._unopened: dict[str, tuple[int, float]] = {}
        for path in self.directory.glob(f"*{_SUFFIX}"):
            st = path.stat()
            self._unopened[path.name] = (st.st_size, st.st_mtime)
        for path in self.directory.glob(f"*{_SUFFIX}.tmp"):
            path.unlink(missing_ok=True)  # a write interrupted by a crash

    @property
    def survives_restart(self) -> bool:
        return True

    def path(self, session_id: str) -> Path:
        """Session ids are client strings: the file is named by their digest."""
        return self.directory / (hashlib.sha256(session_id.encode()).hexdigest()[:40] + _SUFFIX)

    def total_bytes(self) -> int:
        return super().total_bytes() + sum(size for size, _ in self._unopened.values())

    def open(self, session_id: str) -> StoredSession:
        """Read the header of an earlier run's file. A file whose KV does not fit this model,
        or that is shorter than its header says, resumes with its history and no KV."""
        if session_id in self.entries:
            return self.entries[session_id]
        path = self.path(session_id)
        try:
            header, offset = read_kv_header(path)
            stat = path.stat()
            size, mtime = stat.st_size, stat.st_mtime
        except FileNotFoundError:
            raise SessionStoreError(f"no stored session {session_id!r}") from None
        except (OSError, KVFileError) as e:
            raise SessionStoreError(f"cannot read the stored session: {e}") from e
        if header.get("session_id") != session_id:
            raise SessionStoreError(f"the stored file of session {session_id!r} names another "
                                    f"session")
        history = header.get("history")
        kv_token_ids = header.get("token_ids")
        if not isinstance(history, list) or not isinstance(kv_token_ids, list):
            raise SessionStoreError(f"the stored header of session {session_id!r} is malformed")
        refusal = self.expect.refusal(header, _KIND, size - offset)
        if refusal is not None:
            logger.warning("stored KV of session %r refused: %s; it resumes by re-prefilling "
                           "its %d token ids", session_id, refusal, len(history))
            kv_token_ids = []
        self._unopened.pop(path.name, None)
        entry = StoredSession(session_id, history, kv_token_ids, size,
                              time.monotonic() - (time.time() - mtime))
        self.entries[session_id] = entry
        return entry

    def _make_room(self, nbytes: int) -> None:
        if self.max_bytes is not None:
            # Files of earlier runs nobody resumed go first, oldest first.
            for name, (_, _mtime) in sorted(self._unopened.items(), key=lambda kv: kv[1][1]):
                if self.total_bytes() + nbytes <= self.max_bytes:
                    break
                (self.directory / name).unlink(missing_ok=True)
                del self._unopened[name]
        super()._make_room(nbytes)

    def _write(self, session_id: str, history: list[int], kv_token_ids: list[int],
               data: torch.Tensor) -> int | None:
        path = self.path(session_id)
        self._unopened.pop(path.name, None)
        try:
            return write_kv_file(path, _KIND, self.expect, kv_token_ids, data,
                                 session_id=session_id, history=history,
                                 page_size=self.pool.page_size)
        except OSError as e:
            logger.warning("session %r cannot be stored: %s", session_id, e)
            return None

    def _read(self, session_id: str) -> torch.Tensor | None:
        entry = self.entries[session_id]

        def matches(header: dict) -> str | None:
            if (header.get("session_id") != session_id
                    or header.get("token_ids") != entry.kv_token_ids):
                return "the file changed since the session was stored"
            return None

        data = load_kv_file(self.path(session_id), _KIND, self.expect, matches)
        if not isinstance(data, str):
            return data
        logger.warning("stored KV of session %r refused: %s; it re-prefills", session_id,
                       data)
        return None

    def discard(self, session_id: str) -> None:
        super().discard(session_id)
        name = self.path(session_id).name
        if self._unopened.pop(name, None) is not None:
            (self.directory / name).unlink(missing_ok=True)

    def _remove(self, session_id: str) -> None:
        self.path(session_id).unlink(missing_ok=True)


def create_session_store(
    directory: str | None, pool: MHATokenToKVPool, model_path: str, max_gb: float | None,
) -> SessionStore | None:
    """The disk store with ``directory``; else host memory when the pool is on a GPU; else None
    (on a CPU, host memory is the pool's own memory: an idle session is dropped instead)."""
    max_bytes = None if max_gb is None else int(max_gb * (1 << 30))
    if directory is not None:
        expect = KVExpectation.of_pool(pool, model_fingerprint(model_path))
        return DiskSessionStore(directory, pool, expect, max_bytes)
    if pool.device.type == "cuda":
        return HostSessionStore(pool, KVExpectation.of_pool(pool, ""), max_bytes)
    return None
