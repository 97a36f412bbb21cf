"""The Batch API's shapes (docs/batch.md): the body of ``POST /v1/batches``, the lines of an
input file, the batch object and the lines of the output and error files, as OpenAI defines
them.

An input file is JSONL, one request a line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``parse_input`` checks every line before anything runs (the ``validating`` status): a line that
is not such an object, a ``url`` other than the batch's endpoint, a ``custom_id`` used twice,
fails the whole batch with one error per bad line, as OpenAI does. What is wrong inside a
``body`` is the route's to say, per request, in the error file.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from radixserve.server.strict_request import StrictRequest

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one window OpenAI offers
MAX_REQUESTS = 50_000  # lines of one input file (OpenAI's limit)
_MAX_ERRORS = 100  # errors reported for an input file that fails validation
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


class CreateBatchRequest(StrictRequest):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based, as in OpenAI's errors
    custom_id: str
    body: dict[str, Any]


def _error(code: str, message: str, line: int | None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(data: bytes, endpoint: str) -> tuple[list[BatchLine], list[dict]]:
    """The requests of an input file, or the errors that fail it (``errors`` non-empty)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [], [_error("invalid_json_line", "The file is not UTF-8 text.", None)]
    lines: list[BatchLine] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _check_line(raw, number, endpoint, seen)
        if isinstance(problem, BatchLine):
            lines.append(problem)
        elif len(errors) < _MAX_ERRORS:
            errors.append(problem)
    if not lines and not errors:
        errors.append(_error("empty_file", "The input file has no requests.", None))
    if len(lines) > MAX_REQUESTS:
        errors.append(_error("too_many_requests", f"The input file has {len(lines)} requests; "
                             f"a batch takes at most {MAX_REQUESTS}.", None))
    return lines, errors


def _check_line(raw: str, number: int, endpoint: str, seen: set[str]) -> BatchLine | dict:
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        return _error("invalid_json_line", "This line is not valid JSON.", number)
    if not isinstance(doc, dict):
        return _error("invalid_request", "A line must be a JSON object.", number)
    unknown = sorted(doc.keys() - {"custom_id", "method", "url", "body"})
    if unknown:
        return _error("invalid_request", f"Unknown field {unknown[0]!r}.", number, unknown[0])
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error("missing_required_parameter", "custom_id must be a non-empty string.",
                      number, "custom_id")
    if custom_id in seen:
        return _error("duplicate_custom_id", f"The custom_id {custom_id[:64]!r} is used twice.",
                      number, "custom_id")
    if doc.get("method") != "POST":
        return _error("invalid_method", "method must be 'POST'.", number, "method")
    if doc.get("url") != endpoint:
        return _error("mismatched_url", f"url must be the batch's endpoint, {endpoint!r}.",
                      number, "url")
    if not isinstance(doc.get("body"), dict):
        return _error("missing_required_parameter", "body must be a JSON object.", number,
                      "body")
    seen.add(custom_id)
    return BatchLine(number, custom_id, doc["body"])


def new_batch(body: CreateBatchRequest, now: int, owner: str | None = None) -> dict:
    """A batch object just created (status ``validating``), owned by ``owner`` (the caller
    that created it: ``batch_store.OWNER``, stripped before a client sees it)."""
    return {
        "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body.endpoint,
        "errors": None, "input_file_id": body.input_file_id,
        "completion_window": body.completion_window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now,
        "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None,
        "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
        "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata, "_owner": owner,
    }


def result_line(custom_id: str, status_code: int, body: Any) -> dict:
    """A line of the output file (2xx) or the error file (any other status): the response the
    route gave, as OpenAI writes it."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str) -> dict:
    """A line of the error file for a request that got no response (the batch expired or was
    cancelled before it ran)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
