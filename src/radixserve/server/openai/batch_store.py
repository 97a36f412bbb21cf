"""The Batch API's state on disk (docs/batch.md): uploaded files and batches, under one folder
(``--batch-dir``, or a temporary folder that lives as long as the server).

    <root>/files/<file id>.jsonl        a file's bytes (uploads, and the output and error files)
    <root>/files/<file id>.json         its file object (what GET /v1/files/{id} returns)
    <root>/batches/<batch id>.json      the batch object, rewritten at every change of state
    <root>/batches/<batch id>.<kind>.jsonl
                                        result lines (kind ``output`` or ``error``) appended as
                                        requests finish; the batch's output and error files are
                                        made from them when it ends

Each file and batch document also holds ``_owner``, the caller that created it
(``managers/caller.py``; a batch's output and error files are its owner's): the routes show a
caller only what ``may_manage`` lets it see, and strip the field (``public``) before answering.

Every JSON document is written to a temporary name and renamed over the old one, so a crash
leaves the old or the new document, never half of one. Result lines are appended; a crash may
leave a last line cut short, which ``read_results`` drops (that request runs again).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from radixserve.managers.caller import may_manage

OWNER = "_owner"  # the private field of a stored document: who created it


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def public(doc: dict[str, Any]) -> dict[str, Any]:
    """The document as OpenAI shows it: without the private owner field."""
    return {k: v for k, v in doc.items() if k != OWNER}


def _visible(doc: dict[str, Any] | None, caller: str | None) -> dict[str, Any] | None:
    return doc if doc is not None and may_manage(caller, doc.get(OWNER)) else None


def _valid_id(ident: str, prefix: str) -> bool:
    """Ids are ours (``prefix`` + hex): anything else names no file, whatever a client sends."""
    rest = ident.removeprefix(prefix)
    return ident.startswith(prefix) and 0 < len(rest) <= 64 and rest.isalnum()


class BatchStore:
    """Files and batches on disk; the server's one event loop is the only writer."""

    def __init__(self, root: str | None) -> None:
        """``root``: ``--batch-dir`` (created if missing; what it holds survives restarts), or
        None: a temporary folder, removed by ``close``."""
        self.temporary = root is None
        self.root = Path(tempfile.mkdtemp(prefix="radixserve-batch-") if root is None else root)
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ files
    def add_file(self, data: bytes, filename: str, purpose: str, created_at: int,
                 owner: str | None = None) -> dict:
        file_id = f"file-{uuid.uuid4().hex}"
        (self.files_dir / f"{file_id}.jsonl").write_bytes(data)
        meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": created_at,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None, "status_details": None, OWNER: owner}
        _write_json(self.files_dir / f"{file_id}.json", meta)
        return meta

    def file(self, file_id: str, caller: str | None = None) -> dict | None:
        """The file's document, None when there is none or ``caller`` may not see it (the
        default, None, is unscoped: the server's own use)."""
        if not _valid_id(file_id, "file-"):
            return None
        return _visible(_read_json(self.files_dir / f"{file_id}.json"), caller)

    def file_content(self, file_id: str) -> bytes:
        return (self.files_dir / f"{file_id}.jsonl").read_bytes()

    def files(self, caller: str | None = None) -> list[dict]:
        """Every file ``caller`` may see, newest first."""
        docs = [_visible(_read_json(p), caller) for p in self.files_dir.glob("file-*.json")]
        return sorted((d for d in docs if d), key=lambda d: (-d["created_at"], d["id"]))

    def delete_file(self, file_id: str) -> bool:
        if self.file(file_id) is None:
            return False
        (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)
        (self.files_dir / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True

    # ------------------------------------------------------------------ batches
    def save_batch(self, batch: dict) -> None:
        _write_json(self.batches_dir / f"{batch['id']}.json", batch)

    def batch(self, batch_id: str, caller: str | None = None) -> dict | None:
        """The batch's document, None when there is none or ``caller`` may not see it."""
        if not _valid_id(batch_id, "batch_"):
            return None
        return _visible(_read_json(self.batches_dir / f"{batch_id}.json"), caller)

    def batches(self, caller: str | None = None) -> list[dict]:
        """Every batch ``caller`` may see, newest first."""
        docs = [_visible(_read_json(p), caller) for p in self.batches_dir.glob("batch_*.json")]
        return sorted((d for d in docs if d), key=lambda d: (-d["created_at"], d["id"]))

    def results_path(self, batch_id: str, kind: str) -> Path:
        return self.batches_dir / f"{batch_id}.{kind}.jsonl"

    def append_result(self, batch_id: str, kind: str, line: dict) -> None:
        with self.results_path(batch_id, kind).open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_results(self, batch_id: str, kind: str) -> list[dict]:
        """The result lines recorded so far; a last line cut short by a crash is dropped (and
        the file rewritten without it, so appends continue on a clean line)."""
        path = self.results_path(batch_id, kind)
        if not path.exists():
            return []
        lines, intact = [], True
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                intact = False
        if not intact:
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return lines
