"""What a GGUF file's metadata gives (its config dicts, its tokenizer, its tensor table), kept
on disk.

A GGUF file holds its hyper-parameters and its whole tokenizer (vocabulary, merges, chat
template) as metadata, which ``gguf.GGUFReader`` parses in Python, string by string: 3.5 s for
SmolLM2-135M's 49,152-token vocabulary on a 2-core guest, and ``transformers`` takes 9 s to
build the fast tokenizer from a parse of its own. An engine start needs the config in two
processes and the tokenizer in three: about 40 s of CPU spent on the same few megabytes before
the first request, on every start (and the tensor table, in each process that loads weights).
So the first process to build an entry writes it to
``~/.cache/radixserve/gguf/<kind>/<key>`` (``$XDG_CACHE_HOME`` is honoured), into a temporary
directory renamed into place (a concurrent reader sees all of it or none), holding a lock that
the engine's other processes, starting at the same moment, wait on rather than build it too;
they, and every later start, read it (the tokenizer from its ``tokenizer.json`` in half a
second).

The key covers the file's size, its modification time and a digest of its first 16 MiB (the
header: its metadata and tensor table, in every file we know of), so a file rewritten in place
gets a new entry, and the ``version`` the caller gives, which names the code and library
versions that build the entry (a changed translation is never served from an old entry). An
entry that does not load is logged, removed and rebuilt; where the cache cannot be written
(a read-only home), the entry is built in memory each time, as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from radixserve import envs
from radixserve.cache_files import exclusive

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEAD_BYTES = 16 << 20  # the part of the file the key digests


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    """The file's part of every entry's key, read once per process for all its kinds. Any
    write to the file, or a utime, changes its ctime, so a changed file is read again."""
    digest = hashlib.sha256(f"{size}\0{mtime_ns}\0".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
    return digest.hexdigest()


def entry_path(gguf: Path, kind: str, version: str) -> Path:
    """Where ``kind``'s entry for this file (in its present state) and ``version`` lives."""
    st = gguf.stat()
    file_key = _file_digest(str(gguf.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                            st.st_ino)
    key = hashlib.sha256(f"{version}\0{file_key}".encode()).hexdigest()[:32]
    return envs.radixserve_cache_dir("gguf", kind, key)


def cached(gguf: Path, kind: str, version: str, build: Callable[[], T],
           save: Callable[[T, Path], None], load: Callable[[Path], T]) -> T:
    """``load`` of the file's ``kind`` entry; when there is none, or it does not load, what
    ``build`` makes, ``save``d as the entry for the next process. ``build``'s errors (a file we
    cannot read) propagate and leave no entry."""
    entry = entry_path(gguf, kind, version)
    found = _load(entry, load)
    if found is not _MISSING:
        return found
    with contextlib.ExitStack() as stack:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(exclusive(entry.parent / f"{entry.name}.lock"))
        except OSError as e:
            logger.info("GGUF cache %s is not writable (%s): not keeping %s", entry.parent, e,
                        kind)
            return build()
        # An engine's processes start together: one builds, the others wait and load its entry.
        found = _load(entry, load)
        return found if found is not _MISSING else _build_and_save(entry, build, save)


_MISSING = object()


def _load(entry: Path, load: Callable[[Path], T]) -> Any:
    """The entry loaded, or ``_MISSING`` when there is none or it does not load (then removed,
    to be rebuilt)."""
    if not entry.is_dir():
        return _MISSING
    try:
        return load(entry)
    except Exception as e:  # a damaged entry: any error of the loader, which we rebuild
        logger.warning("GGUF cache entry %s does not load (%s): rebuilding it", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return _MISSING


def _build_and_save(entry: Path, build: Callable[[], T], save: Callable[[T, Path], None]) -> T:
    value = build()
    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        logger.info("GGUF cache %s is not writable (%s)", entry.parent, e)
        return value
    try:
        save(value, scratch)
        os.rename(scratch, entry)  # fails when another process put the entry there first
    except OSError:
        pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return value


def cached_json(gguf: Path, kind: str, version: str, build: Callable[[], Any]) -> Any:
    """``cached`` for what JSON holds; built or loaded, the value is what JSON gives back (a
    tuple comes as a list), so a process that built the entry sees what the others read."""

    def save(value: Any, directory: Path) -> None:
        (directory / "value.json").write_text(json.dumps(value))

    def load(directory: Path) -> Any:
        return json.loads((directory / "value.json").read_text())

    return cached(gguf, kind, version, lambda: json.loads(json.dumps(build())), save, load)
