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

The file format (all integers little endian)::

    b"RXSESS\\x00\\x01"                     magic and format version
    u32 header length, u32 CRC-32 of the header
    header: UTF-8 JSON {session_id, fingerprint, dtype, page_size, layer_num, head_num,
            head_dim, token_ids, kv_token_ids, payload_bytes, payload_crc32}
    payload: K of every layer, then V of every layer, each [len(kv_token_ids), head_num,
             head_dim]

``token_ids`` is the session's history (what its next turn continues); the payload holds the KV
of ``kv_token_ids`` (the session's slot: usually the history but its last token, more after a
retracted turn). KV is stored per token, so it restores into a pool of any page size.
A file whose fingerprint, dtype or shapes differ from the running model's, or that is shorter
than its header says, is refused when the session resumes; a payload whose checksum fails is
refused when it is loaded. Refused KV is never used: the session re-prefills its token ids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.mem_cache.kv_pool import MHATokenToKVPool

logger = logging.getLogger(__name__)

MAGIC = b"RXSESS\x00\x01"
_PREFIX = struct.Struct("<II")  # header length, header CRC-32
_SUFFIX = ".session"
_FINGERPRINT_SAMPLES = 16
_SAMPLE_BYTES = 1 << 16


class SessionStoreError(LookupError):
    """A stored session that cannot be resumed (missing, or its header is unreadable)."""


@dataclass(frozen=True)
class KVLayout:
    """What stored KV must match to be loaded into this pool."""

    fingerprint: str
    dtype: torch.dtype
    layer_num: int
    head_num: int
    head_dim: int
    page_size: int

    @classmethod
    def of_pool(cls, pool: MHATokenToKVPool, fingerprint: str) -> KVLayout:
        return cls(fingerprint, pool.dtype, pool.layer_num, pool.head_num, pool.head_dim,
                   pool.page_size)

    def mismatch(self, header: dict) -> str | None:
        """Why KV described by ``header`` cannot be used here, or None."""
        if header.get("fingerprint") != self.fingerprint:
            return "it was computed by a different model (fingerprint mismatch)"
        if header.get("dtype") != str(self.dtype).removeprefix("torch."):
            return f"its dtype {header.get('dtype')} is not the pool's {self.dtype}"
        shape = (header.get("layer_num"), header.get("head_num"), header.get("head_dim"))
        if shape != (self.layer_num, self.head_num, self.head_dim):
            return f"its KV shape {shape} is not the pool's"
        return None

    def bytes_per_token(self) -> int:
        return MHATokenToKVPool.bytes_per_token(self.head_num, self.head_dim, self.layer_num,
                                                self.dtype)


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


def model_fingerprint(model_path: str | Path) -> str:
    """A digest of a checkpoint that changes when its weights or config do.

    Hashing every byte of a large checkpoint at start-up would cost seconds per GB, so it reads
    config.json, each safetensors header (names, dtypes, shapes, offsets) and evenly spaced
    samples of the tensor data (of a GGUF file: samples of the whole file): retrained or
    fine-tuned weights differ everywhere.
    """
    path = Path(model_path)
    digest = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_len, size)))
            data_start = 8 + header_len
            span = max(size - data_start - _SAMPLE_BYTES, 0)
            for i in range(_FINGERPRINT_SAMPLES):
                f.seek(data_start + span * i // max(_FINGERPRINT_SAMPLES - 1, 1))
                digest.update(f.read(_SAMPLE_BYTES))
    # A GGUF checkpoint (the file, or the one in the directory): samples across the whole file,
    # the first of which covers its header.
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    for weights in ggufs:
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            span = max(size - _SAMPLE_BYTES, 0)
            for i in range(_FINGERPRINT_SAMPLES):
                f.seek(span * i // max(_FINGERPRINT_SAMPLES - 1, 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


class SessionStore(ABC):
    """A bounded map session id → (history, KV of its first ``kv_tokens``), least recently used
    sessions dropped first. KV moves between the store and the pool's slots; the pool's
    allocator and request rows are the caller's business."""

    def __init__(self, pool: MHATokenToKVPool, layout: KVLayout, max_bytes: int | None) -> None:
        self.pool = pool
        self.layout = layout
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
        store's bound (nothing is stored then)."""
        assert len(kv_indices) == len(kv_token_ids), "one pool slot per token"
        nbytes = self._size(len(token_ids) + len(kv_token_ids), len(kv_token_ids))
        self.discard(session_id)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            logger.info("session %r (%d bytes) exceeds the store's bound", session_id, nbytes)
            return False
        self._make_room(nbytes)
        payload = self._gather(kv_indices)
        header = {
            "session_id": session_id,
            "fingerprint": self.layout.fingerprint,
            "dtype": str(self.layout.dtype).removeprefix("torch."),
            "page_size": self.layout.page_size,
            "layer_num": self.layout.layer_num,
            "head_num": self.layout.head_num,
            "head_dim": self.layout.head_dim,
            "token_ids": list(token_ids),
            "kv_token_ids": list(kv_token_ids),
            "payload_bytes": payload.numel(),
        }
        nbytes = self._write(session_id, header, payload)
        self.entries[session_id] = StoredSession(
            session_id, list(token_ids), list(kv_token_ids), nbytes, time.monotonic()
        )
        return True

    def load(self, session_id: str, kv_indices: torch.Tensor) -> bool:
        """Copy the session's stored KV into pool slots ``kv_indices`` (one per stored token).
        False, with the session dropped from the store, when its payload is refused."""
        entry = self.entries[session_id]
        assert len(kv_indices) == entry.kv_tokens, "load into as many slots as tokens stored"
        payload = self._read(session_id, entry.kv_tokens)
        if payload is None:
            self.discard(session_id)
            return False
        index = kv_indices.to(self.pool.device)
        offset = 0
        for buffer in self._buffers():
            nbytes = entry.kv_tokens * buffer[0].numel() * buffer.element_size()
            rows = payload[offset:offset + nbytes].view(buffer.dtype).view(-1, *buffer.shape[1:])
            buffer[index] = rows.to(self.pool.device, non_blocking=True)
            offset += nbytes
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
        """Bytes a stored session takes (the header estimated at 8 bytes per token id)."""
        return kv_tokens * self.layout.bytes_per_token() + 8 * num_ids + 512

    def _make_room(self, nbytes: int) -> None:
        if self.max_bytes is None:
            return
        for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
            if self.total_bytes() + nbytes <= self.max_bytes:
                return
            logger.info("session store full: dropping session %r", entry.session_id)
            self.discard(entry.session_id)

    def _gather(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """The KV of ``kv_indices`` as one flat CPU byte tensor, the slots' rows of each of
        ``_buffers``."""
        index = kv_indices.to(self.pool.device)
        parts = [buffer[index].cpu().contiguous().view(-1).view(torch.uint8)
                 for buffer in self._buffers()]
        return torch.cat(parts)

    def _buffers(self) -> list[torch.Tensor]:
        """The pool's buffers in payload order: K of every layer, then V, then (a quantized
        pool) the K scales and the V scales: an unquantized payload is laid out as before."""
        per_layer = [self.pool.slot_buffers(i) for i in range(self.layout.layer_num)]
        kinds = len(per_layer[0]) if per_layer else 0
        return [buffers[kind] for kind in range(kinds) for buffers in per_layer]

    @abstractmethod
    def _write(self, session_id: str, header: dict, payload: torch.Tensor) -> int:
        """Keep ``header`` and ``payload``; return the bytes they take."""

    @abstractmethod
    def _read(self, session_id: str, kv_tokens: int) -> torch.Tensor | None:
        """The payload as a flat byte tensor, or None when it is refused."""

    @abstractmethod
    def _remove(self, session_id: str) -> None:
        """Forget what ``_write`` kept."""


class HostSessionStore(SessionStore):
    """Sessions in host memory, pinned when the pool is on a GPU (fast device copies)."""

    def __init__(self, pool: MHATokenToKVPool, layout: KVLayout, max_bytes: int | None) -> None:
        super().__init__(pool, layout, max_bytes)
        self._payloads: dict[str, torch.Tensor] = {}
        self._pin = pool.device.type == "cuda"

    def _write(self, session_id: str, header: dict, payload: torch.Tensor) -> int:
        self._payloads[session_id] = payload.pin_memory() if self._pin else payload.clone()
        return self._size(len(header["token_ids"]) + len(header["kv_token_ids"]),
                          len(header["kv_token_ids"]))

    def _read(self, session_id: str, kv_tokens: int) -> torch.Tensor | None:
        return self._payloads[session_id]

    def _remove(self, session_id: str) -> None:
        self._payloads.pop(session_id, None)


class DiskSessionStore(SessionStore):
    """A file per session under ``directory`` (format in the module docstring).

    Files of earlier runs are indexed by name at start-up (they count against the bound, and
    the least recently modified go first); their headers are read when a session resumes.
    """

    def __init__(
        self, directory: str | Path, pool: MHATokenToKVPool, layout: KVLayout,
        max_bytes: int | None,
    ) -> None:
        super().__init__(pool, layout, max_bytes)
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
        or that is shorter than its header says, resumes with its token ids and no KV."""
        if session_id in self.entries:
            return self.entries[session_id]
        path = self.path(session_id)
        header, offset = self._read_header(path)
        if header.get("session_id") != session_id:
            raise SessionStoreError(f"the stored file of session {session_id!r} names another "
                                    f"session")
        token_ids = header.get("token_ids")
        kv_token_ids = header.get("kv_token_ids")
        if not isinstance(token_ids, list) or not isinstance(kv_token_ids, list):
            raise SessionStoreError(f"the stored header of session {session_id!r} is malformed")
        refusal = self.layout.mismatch(header)
        if refusal is None and path.stat().st_size - offset != header.get("payload_bytes"):
            refusal = "the file is truncated"
        if refusal is not None:
            logger.warning("stored KV of session %r refused: %s; it resumes by re-prefilling "
                           "its %d token ids", session_id, refusal, len(token_ids))
            kv_token_ids = []
        size, mtime = self._unopened.pop(path.name, (path.stat().st_size, time.time()))
        entry = StoredSession(session_id, token_ids, kv_token_ids, size,
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

    def _write(self, session_id: str, header: dict, payload: torch.Tensor) -> int:
        data = payload.numpy()
        header = {**header, "payload_crc32": zlib.crc32(data)}
        blob = json.dumps(header, separators=(",", ":")).encode()
        path = self.path(session_id)
        self._unopened.pop(path.name, None)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(_PREFIX.pack(len(blob), zlib.crc32(blob)))
            f.write(blob)
            f.write(memoryview(data))
        os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one
        return len(MAGIC) + _PREFIX.size + len(blob) + data.nbytes

    def _read(self, session_id: str, kv_tokens: int) -> torch.Tensor | None:
        path = self.path(session_id)
        try:
            header, offset = self._read_header(path)
            nbytes = header["payload_bytes"]
            payload = torch.empty(nbytes, dtype=torch.uint8)
            with open(path, "rb") as f:
                f.seek(offset)
                got = f.readinto(memoryview(payload.numpy()))
        except (OSError, SessionStoreError, KeyError) as e:
            logger.warning("stored KV of session %r refused: %s", session_id, e)
            return None
        if got != nbytes or nbytes != kv_tokens * self.layout.bytes_per_token():
            logger.warning("stored KV of session %r refused: the file is truncated", session_id)
            return None
        if zlib.crc32(payload.numpy()) != header.get("payload_crc32"):
            logger.warning("stored KV of session %r refused: its checksum fails", session_id)
            return None
        return payload

    def discard(self, session_id: str) -> None:
        super().discard(session_id)
        name = self.path(session_id).name
        if self._unopened.pop(name, None) is not None:
            (self.directory / name).unlink(missing_ok=True)

    def _remove(self, session_id: str) -> None:
        self.path(session_id).unlink(missing_ok=True)

    def _read_header(self, path: Path) -> tuple[dict, int]:
        """The header of ``path`` and the offset of its payload; ``SessionStoreError``."""
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise SessionStoreError(f"{path.name} is not a session file")
                prefix = f.read(_PREFIX.size)
                if len(prefix) != _PREFIX.size:
                    raise SessionStoreError(f"{path.name} is truncated")
                length, crc = _PREFIX.unpack(prefix)
                blob = f.read(length)
        except FileNotFoundError:
            raise SessionStoreError("no stored session with this id") from None
        except OSError as e:
            raise SessionStoreError(f"cannot read the stored session: {e}") from e
        if len(blob) != length or zlib.crc32(blob) != crc:
            raise SessionStoreError("the stored session's header is truncated or corrupt")
        try:
            header = json.loads(blob)
        except ValueError as e:
            raise SessionStoreError("the stored session's header is corrupt") from e
        return header, len(MAGIC) + _PREFIX.size + length


def create_session_store(
    directory: str | None, pool: MHATokenToKVPool, model_path: str, max_gb: float | None,
) -> SessionStore | None:
    """The disk store with ``directory``; else host memory when the pool is on a GPU; else None
    (on a CPU, host memory is the pool's own memory: an idle session is dropped instead)."""
    max_bytes = None if max_gb is None else int(max_gb * (1 << 30))
    if directory is not None:
        layout = KVLayout.of_pool(pool, model_fingerprint(model_path))
        return DiskSessionStore(directory, pool, layout, max_bytes)
    if pool.device.type == "cuda":
        return HostSessionStore(pool, KVLayout.of_pool(pool, ""), max_bytes)
    return None
