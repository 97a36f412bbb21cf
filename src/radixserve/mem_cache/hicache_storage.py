"""The storage tier of the hierarchical cache: KV blocks in files that outlive the process.

``--hicache-storage-backend file --hicache-storage-dir DIR``. The unit is a *block* of
``block_tokens`` tokens (a whole number of KV pages, at least ``MIN_BLOCK_TOKENS``) at a
block-aligned position of a prefix; a block is named by a chain hash of every token from the
start of the prefix to its end, so a block is found from the token ids alone: after a restart,
with an empty radix tree, a prompt's leading blocks are looked up hash by hash.

The file format, one file ``<hash>.kvblock`` per block (integers little endian)::

    bytes 0..7    b"RXKVBLK" + u8 format version (FORMAT_VERSION)
    bytes 8..15   u32 header length, u32 CRC-32 of the header
    header        UTF-8 JSON: format_version, fingerprint (the model's), layout (the KV pool's
                  ``kv_layout()``: dtype, shapes, bytes per token), page_size, block_tokens,
                  prefix_hash, token_ids (the block's), payload_bytes, payload_crc32
    padding       zeros up to HEADER_BYTES (4096): the payload starts page aligned
    payload       [block_tokens, kv_bytes_per_token] bytes: the pool's ``read_kv_pages`` format

A file is read only when everything matches: magic, version, header checksum, the model
fingerprint, the pool layout, the block's token ids, the payload length and its checksum.
Anything else (another model, another dtype, a truncated or corrupted file) is refused with a
warning, deleted, and its tokens are recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"RXKVBLK"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_PREFIX = struct.Struct("<II")  # header length, header CRC-32
_SUFFIX = ".kvblock"
MIN_BLOCK_TOKENS = 64
_ROOT_HASH = b"radixserve-hicache"


def block_tokens_for(page_size: int) -> int:
    """Tokens per storage block: the smallest whole number of pages >= MIN_BLOCK_TOKENS."""
    return page_size * -(-MIN_BLOCK_TOKENS // page_size)


def chain_hashes(key: list[int], block_tokens: int) -> list[str]:
    """The hash of every whole block of ``key``: block ``i``'s covers ``key[:(i+1)*block]``."""
    out: list[str] = []
    prev = _ROOT_HASH
    for start in range(0, len(key) - block_tokens + 1, block_tokens):
        block = key[start : start + block_tokens]
        digest = hashlib.sha256(prev)
        digest.update(struct.pack(f"<{len(block)}q", *block))
        prev = digest.digest()
        out.append(prev.hex()[:48])
    return out


class FileKVStorage:
    """A directory of KV blocks (format in the module docstring)."""

    def __init__(
        self, directory: str | Path, fingerprint: str, layout: dict[str, object],
        page_size: int,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.layout = layout
        self.page_size = page_size
        self.block_tokens = block_tokens_for(page_size)
        self.bytes_per_token = int(layout["kv_bytes_per_token"])  # type: ignore[call-overload]
        for tmp in self.directory.glob(f"*{_SUFFIX}.tmp"):
            tmp.unlink(missing_ok=True)  # a write interrupted by a crash
        # Blocks by name; their headers are checked when they are read.
        self._index: set[str] = {p.name.removesuffix(_SUFFIX)
                                 for p in self.directory.glob(f"*{_SUFFIX}")}
        self.refused = 0  # files refused since start (foreign, corrupt)

    def stored_tokens(self) -> int:
        return len(self._index) * self.block_tokens

    def contains(self, block_hash: str) -> bool:
        return block_hash in self._index

    def path(self, block_hash: str) -> Path:
        return self.directory / (block_hash + _SUFFIX)

    def put(self, block_hash: str, token_ids: list[int], data: torch.Tensor) -> None:
        """Write one block (``data``: ``[block_tokens, bytes_per_token]`` uint8) unless stored."""
        if block_hash in self._index:
            return
        assert data.shape == (self.block_tokens, self.bytes_per_token), tuple(data.shape)
        payload = data.cpu().contiguous().numpy()
        header = {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "layout": self.layout,
            "page_size": self.page_size,
            "block_tokens": self.block_tokens,
            "prefix_hash": block_hash,
            "token_ids": list(token_ids),
            "payload_bytes": payload.nbytes,
            "payload_crc32": zlib.crc32(payload),
        }
        blob = json.dumps(header, separators=(",", ":")).encode()
        head = MAGIC + bytes([FORMAT_VERSION]) + _PREFIX.pack(len(blob), zlib.crc32(blob)) + blob
        if len(head) > HEADER_BYTES:  # token ids of a huge block: pad to the next page
            pad = -len(head) % HEADER_BYTES
        else:
            pad = HEADER_BYTES - len(head)
        path = self.path(block_hash)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(b"\0" * pad)
                f.write(memoryview(payload))
            os.replace(tmp, path)  # a crash leaves no half-written block under its name
        except OSError as e:
            logger.warning("hicache storage: cannot write block %s: %s", block_hash, e)
            tmp.unlink(missing_ok=True)
            return
        self._index.add(block_hash)

    def get(self, block_hash: str, token_ids: list[int]) -> torch.Tensor | None:
        """The block's KV bytes, or ``None`` (not stored, or refused: then deleted)."""
        if block_hash not in self._index:
            return None
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            return self._refuse(block_hash, f"cannot read it: {e}")
        reason, header, offset = self._parse(raw)
        if reason is None and header.get("token_ids") != list(token_ids):
            reason = "its token ids differ (hash collision or stale file)"
        if reason is not None:
            return self._refuse(block_hash, reason)
        payload = raw[offset : offset + header["payload_bytes"]]
        if zlib.crc32(payload) != header.get("payload_crc32"):
            return self._refuse(block_hash, "its payload checksum fails")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return data.view(self.block_tokens, self.bytes_per_token)

    def _parse(self, raw: bytes) -> tuple[str | None, dict, int]:
        """``(refusal or None, header, payload offset)`` of a block file's bytes."""
        if raw[: len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 1 + _PREFIX.size:
            return "it is not a KV block file", {}, 0
        if raw[len(MAGIC)] != FORMAT_VERSION:
            return f"its format version {raw[len(MAGIC)]} is not {FORMAT_VERSION}", {}, 0
        start = len(MAGIC) + 1 + _PREFIX.size
        length, crc = _PREFIX.unpack(raw[len(MAGIC) + 1 : start])
        blob = raw[start : start + length]
        if len(blob) != length or zlib.crc32(blob) != crc:
            return "its header is truncated or corrupt", {}, 0
        try:
            header = json.loads(blob)
        except ValueError:
            return "its header is corrupt", {}, 0
        offset = start + length
        offset += (HEADER_BYTES - offset) if offset <= HEADER_BYTES else -offset % HEADER_BYTES
        if header.get("format_version") != FORMAT_VERSION:
            return "its format version differs", header, offset
        if header.get("fingerprint") != self.fingerprint:
            return "it was computed by a different model (fingerprint mismatch)", header, offset
        if header.get("layout") != self.layout:
            return f"its KV layout {header.get('layout')} is not the pool's", header, offset
        if header.get("block_tokens") != self.block_tokens:
            return "its block size differs", header, offset
        nbytes = self.block_tokens * self.bytes_per_token
        if header.get("payload_bytes") != nbytes or len(raw) - offset != nbytes:
            return "it is truncated", header, offset
        return None, header, offset

    def _refuse(self, block_hash: str, reason: str) -> None:
        logger.warning("hicache storage: block %s refused: %s; its tokens are recomputed",
                       block_hash, reason)
        self.refused += 1
        self._index.discard(block_hash)
        self.path(block_hash).unlink(missing_ok=True)
        return None
