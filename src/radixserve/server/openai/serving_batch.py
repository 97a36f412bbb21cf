"""OpenAI's Files and Batch routes (docs/batch.md): upload a JSONL file of requests, start a
batch over it, follow it, cancel it, read its output and error files.

    POST   /v1/files                  multipart: file, purpose ("batch")
    GET    /v1/files                  GET /v1/files/{id}    GET /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/batches                GET /v1/batches (list)    GET /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

An upload is bounded by the server's request body limit (``request_guard.MAX_BODY_BYTES``,
8 MiB: 413 past it). With API keys configured, a file or batch belongs to the key that created
it (a batch's output and error files to the batch's key): another key gets the 404 of an id
that does not exist, as OpenAI answers for ids another organisation owns; the admin key sees
everything (``managers/caller.py``). The state lives in ``batch_store.py``; ``batch_runner.py``
runs batches.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from radixserve.managers.caller import current_caller
from radixserve.server.errors import APIError
from radixserve.server.openai.batch_protocol import CreateBatchRequest, new_batch
from radixserve.server.openai.batch_runner import BatchRunner
from radixserve.server.openai.batch_store import BatchStore, public
from radixserve.server.parsed_body import ParsedBodyRoute

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py

FILE_PURPOSES = ("batch",)  # what an upload may be for; batch_output files are the server's


def _runner(request: Request) -> BatchRunner:
    return request.app.state.batch_runner


def _store(request: Request) -> BatchStore:
    return _runner(request).store


def _file_or_404(store: BatchStore, file_id: str) -> dict:
    meta = store.file(file_id, current_caller.get())
    if meta is None:
        raise APIError(404, f"No file with id {file_id[:80]!r}.", param="file_id")
    return meta


def _batch_or_404(runner: BatchRunner, batch_id: str) -> dict:
    batch = runner.get(batch_id, current_caller.get())
    if batch is None:
        raise APIError(404, f"No batch with id {batch_id[:80]!r}.", param="batch_id")
    return batch


# ---------------------------------------------------------------------------- files
@router.post("/v1/files")
async def upload_file(request: Request) -> JSONResponse:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "Upload a file as multipart/form-data with the fields 'file' and "
                       "'purpose'.")
    async with request.form(max_files=1, max_fields=4) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str):
            raise APIError(400, "The field 'purpose' is required.", param="purpose")
        if purpose not in FILE_PURPOSES:
            raise APIError(400, f"purpose must be one of {list(FILE_PURPOSES)}, got "
                           f"{purpose[:40]!r}.", param="purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "The field 'file' (a file) is required.", param="file")
        data = await upload.read()
        filename = (upload.filename or "upload.jsonl")[:255]
    if not data.strip():
        raise APIError(400, "The file is empty.", param="file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "A batch file must be UTF-8 JSONL.", param="file") from None
    meta = _store(request).add_file(data, filename, purpose, int(time.time()),
                                    current_caller.get())
    return JSONResponse(public(meta))


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None) -> JSONResponse:
    files = [public(f) for f in _store(request).files(current_caller.get())
             if purpose is None or f["purpose"] == purpose]
    return JSONResponse({"object": "list", "data": files, "has_more": False})


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(public(_file_or_404(_store(request), file_id)))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    store = _store(request)
    _file_or_404(store, file_id)
    return Response(store.file_content(file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    store = _store(request)
    _file_or_404(store, file_id)
    store.delete_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# ---------------------------------------------------------------------------- batches
@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, request: Request) -> JSONResponse:
    runner = _runner(request)
    caller = current_caller.get()
    meta = runner.store.file(body.input_file_id, caller)
    if meta is None:
        raise APIError(404, f"No file with id {body.input_file_id[:80]!r}.",
                       param="input_file_id")
    if meta["purpose"] != "batch":
        raise APIError(400, "The input file's purpose must be 'batch'.", param="input_file_id")
    batch = new_batch(body, int(time.time()), caller)
    runner.store.save_batch(batch)
    runner.start(batch["id"])
    return JSONResponse(public(batch))


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20
                       ) -> JSONResponse:
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100, got {limit}.", param="limit")
    batches = [public(b) for b in _runner(request).all(current_caller.get())]
    if after is not None:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1:] if after in ids else []
    page = batches[:limit]
    return JSONResponse({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit,
    })


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(public(_batch_or_404(_runner(request), batch_id)))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    runner = _runner(request)
    batch = _batch_or_404(runner, batch_id)
    if batch["status"] not in ("validating", "in_progress", "cancelling"):
        raise APIError(409, f"The batch is {batch['status']}: only a validating or in-progress "
                       "batch can be cancelled.", param="batch_id")
    return JSONResponse(public(runner.cancel(batch)))
