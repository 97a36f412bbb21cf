"""The one file format KV leaves the process in: the storage tier's blocks and the session store's
sessions both write and read it here, with the same checks.

A file holds the KV of a run of tokens in the pool's tier format (``MHATokenToKVPool.
read_kv_pages``: per token, K of every layer, V of every layer, then a quantized pool's scales),
so whatever the pool stores per token travels unchanged, and it restores into a pool of any page
size. Integers little endian::

    bytes 0..7    b"RXKVBLK" + u8 format version (FORMAT_VERSION)
    bytes 8..15   u32 header length, u32 CRC-32 of the header
    header        UTF-8 JSON: format_version, kind ("block" or "session"), fingerprint (the
                  model's, ``model_fingerprint``), layout (the pool's ``kv_layout()``: dtype,
                  shapes, bytes per token), token_ids (the tokens whose KV the payload holds),
                  payload_bytes, payload_crc32, and the fields of its kind (a block: page_size,
                  block_tokens, prefix_hash; a session: session_id, history, page_size)
    padding       zeros up to HEADER_BYTES (4096), or to the next multiple of it when the header
                  is longer: the payload starts page aligned
    payload       [len(token_ids), kv_bytes_per_token] bytes

A header is readable when its magic, version and checksum are right (``read_kv_header``, else
``KVFileError``); its KV is usable when it is of the expected kind, the model fingerprint and the
pool layout match and the file holds the whole payload (``KVExpectation.refusal``); a payload is
loaded only when its checksum holds (``read_kv_payload``). Writes go to a temporary file renamed
over the name, so a crash never leaves half a file under it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"RXKVBLK"
FORMAT_VERSION = 2  # 1: blocks only, no "kind"
HEADER_BYTES = 4096
_PREFIX = struct.Struct("<II")  # header length, header CRC-32
_START = len(MAGIC) + 1 + _PREFIX.size
_FINGERPRINT_SAMPLES = 16
_SAMPLE_BYTES = 1 << 16


class KVFileError(ValueError):
    """A file whose header cannot be read: not a KV file, another format version, a header
    truncated or corrupt."""


@dataclass(frozen=True)
class KVExpectation:
    """What stored KV must match to be loaded into a pool: the model and the pool's layout."""

    fingerprint: str
    layout: dict[str, Any]

    @classmethod
    def of_pool(cls, pool: Any, fingerprint: str) -> KVExpectation:
        return cls(fingerprint, pool.kv_layout())

    @property
    def bytes_per_token(self) -> int:
        return int(self.layout["kv_bytes_per_token"])

    def refusal(self, header: dict, kind: str, payload_bytes_in_file: int) -> str | None:
        """Why the KV a header describes cannot be used here (``payload_bytes_in_file``: the
        file's bytes past the header), or None."""
        if header.get("kind") != kind:
            return f"it holds a {header.get('kind')!r}, not a {kind!r}"
        if header.get("fingerprint") != self.fingerprint:
            return "it was computed by a different model (fingerprint mismatch)"
        if header.get("layout") != self.layout:
            return f"its KV layout {header.get('layout')} is not the pool's {self.layout}"
        token_ids = header.get("token_ids")
        if not isinstance(token_ids, list):
            return "its header is malformed"
        nbytes = len(token_ids) * self.bytes_per_token
        if header.get("payload_bytes") != nbytes or payload_bytes_in_file != nbytes:
            return "it is truncated"
        return None


def write_kv_file(path: Path, kind: str, expect: KVExpectation, token_ids: list[int],
                  data: torch.Tensor, **fields: Any) -> int:
    """Write the KV ``data`` (``[len(token_ids), bytes_per_token]`` uint8, the pool's tier
    format) of ``token_ids`` to ``path``, atomically; return the file's size. ``OSError``."""
    assert data.shape == (len(token_ids), expect.bytes_per_token), tuple(data.shape)
    payload = data.cpu().contiguous().numpy()
    header = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "fingerprint": expect.fingerprint,
        "layout": expect.layout,
        **fields,
        "token_ids": list(token_ids),
        "payload_bytes": payload.nbytes,
        "payload_crc32": zlib.crc32(payload),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    head = MAGIC + bytes([FORMAT_VERSION]) + _PREFIX.pack(len(blob), zlib.crc32(blob)) + blob
    head += b"\0" * (_payload_offset(len(blob)) - len(head))
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(memoryview(payload))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return len(head) + payload.nbytes


def read_kv_header(path: Path) -> tuple[dict, int]:
    """The header of ``path`` and the offset of its payload. ``KVFileError`` when the header
    cannot be read; ``OSError`` (``FileNotFoundError``) when the file cannot."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        if head[: len(MAGIC)] != MAGIC or len(head) < _START:
            raise KVFileError(f"{path.name} is not a KV file")
        if head[len(MAGIC)] != FORMAT_VERSION:
            raise KVFileError(f"{path.name} has format version {head[len(MAGIC)]}, "
                              f"not {FORMAT_VERSION}")
        length, crc = _PREFIX.unpack(head[len(MAGIC) + 1 : _START])
        blob = head[_START : _START + length]
        if len(blob) < length:
            blob += f.read(length - len(blob))
    if len(blob) != length or zlib.crc32(blob) != crc:
        raise KVFileError(f"the header of {path.name} is truncated or corrupt")
    try:
        header = json.loads(blob)
    except ValueError as e:
        raise KVFileError(f"the header of {path.name} is corrupt") from e
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        raise KVFileError(f"the header of {path.name} is malformed")
    return header, _payload_offset(length)


def read_kv_payload(path: Path, header: dict, offset: int, expect: KVExpectation
                    ) -> torch.Tensor | str:
    """The payload of a checked header as ``[len(token_ids), bytes_per_token]`` uint8, or why
    it is refused (unreadable, truncated, its checksum fails)."""
    nbytes = header["payload_bytes"]
    payload = torch.empty(nbytes, dtype=torch.uint8)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.readinto(memoryview(payload.numpy()))
    except OSError as e:
        return f"cannot read it: {e}"
    if got != nbytes:
        return "it is truncated"
    if zlib.crc32(payload.numpy()) != header.get("payload_crc32"):
        return "its payload checksum fails"
    return payload.view(-1, expect.bytes_per_token)


def load_kv_file(path: Path, kind: str, expect: KVExpectation,
                 matches: Callable[[dict], str | None]) -> torch.Tensor | str:
    """The KV of ``path`` when all of it can be used here, else why not: its header readable,
    ``expect.refusal`` and the caller's own ``matches(header)`` (what it must be the KV of)
    passed, then the payload read and its checksum held (``read_kv_payload``)."""
    try:
        header, offset = read_kv_header(path)
        refusal = expect.refusal(header, kind, path.stat().st_size - offset)
    except (OSError, KVFileError) as e:
        return str(e)
    refusal = refusal or matches(header)
    if refusal is not None:
        return refusal
    return read_kv_payload(path, header, offset, expect)


def _payload_offset(header_length: int) -> int:
    """Where the payload starts: the header padded to a whole number of HEADER_BYTES."""
    end = _START + header_length
    return max(HEADER_BYTES, -(-end // HEADER_BYTES) * HEADER_BYTES)


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
