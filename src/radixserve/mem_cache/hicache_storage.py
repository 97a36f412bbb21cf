"""The storage tier of the hierarchical cache: KV blocks in files that outlive the process.

``--hicache-storage-backend file --hicache-storage-dir DIR``. The unit is a *block* of
``block_tokens`` tokens (a whole number of KV pages, at least ``MIN_BLOCK_TOKENS``) at a
block-aligned position of a prefix; a block is named by a chain hash of every token from the
start of the prefix to its end, so a block is found from the token ids alone: after a restart,
with an empty radix tree, a prompt's leading blocks are looked up hash by hash.

The file format (``mem_cache/kv_file.py``, shared with the session store): one file
``<hash>.kvblock`` per block, of kind ``"block"``, whose header also names its ``page_size``,
``block_tokens`` and ``prefix_hash``; the payload (page aligned) is the block's KV in the pool's
``read_kv_pages`` format, a quantized pool's scales included.

A file is read only when everything matches: magic, version, header checksum, the kind, the model
fingerprint, the pool layout, the block size, the block's token ids, the payload length and its
checksum. Anything else (another model, another dtype, a truncated or corrupted file) is refused
with a warning, deleted, and its tokens are recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path

import torch

from radixserve.mem_cache.kv_file import KVExpectation, load_kv_file, write_kv_file

logger = logging.getLogger(__name__)

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
        self.expect = KVExpectation(fingerprint, dict(layout))
        self.page_size = page_size
        self.block_tokens = block_tokens_for(page_size)
        self.bytes_per_token = self.expect.bytes_per_token
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
        try:
            write_kv_file(self.path(block_hash), "block", self.expect, token_ids, data,
                          page_size=self.page_size, block_tokens=self.block_tokens,
                          prefix_hash=block_hash)
        except OSError as e:
            logger.warning("hicache storage: cannot write block %s: %s", block_hash, e)
            return
        self._index.add(block_hash)

    def get(self, block_hash: str, token_ids: list[int]) -> torch.Tensor | None:
        """The block's KV bytes, or ``None`` (not stored, or refused: then deleted)."""
        if block_hash not in self._index:
            return None

        def matches(header: dict) -> str | None:
            if header.get("block_tokens") != self.block_tokens:
                return "its block size differs"
            if header.get("token_ids") != list(token_ids):
                return "its token ids differ (hash collision or stale file)"
            return None

        data = load_kv_file(self.path(block_hash), "block", self.expect, matches)
        if isinstance(data, str):
            return self._refuse(block_hash, data)
        return data

    def _refuse(self, block_hash: str, reason: str) -> None:
        logger.warning("hicache storage: block %s refused: %s; its tokens are recomputed",
                       block_hash, reason)
        self.refused += 1
        self._index.discard(block_hash)
        self.path(block_hash).unlink(missing_ok=True)
        return None
