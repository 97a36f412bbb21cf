"""What the table-driven bad-request suites share (``test_bad_inputs.py``,
``test_hostile_requests.py``): a case, how it is sent, and the OpenAI error object it must get."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

INVALID = (400, "invalid_request_error")
NOT_FOUND = (404, "not_found_error")


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None  # JSON-encoded with Python's json (NaN, big ints, escaped surrogates) or bytes
    expected: tuple[int, str] = INVALID
    message: str = ""  # a substring of the error message (case-insensitive)
    param: str | None = None  # the error's ``param``, when the case names one
    method: str = "POST"
    reaches_scheduler: bool = False  # refused by the scheduler itself (an unknown session)


def send(client: httpx.Client, case: Case) -> httpx.Response:
    if case.body is None and case.method != "POST":
        return client.request(case.method, case.path)
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return client.request(case.method, case.path, content=content,
                          headers={"content-type": "application/json"})


def assert_error_object(r: httpx.Response, case: Case) -> dict[str, Any]:
    """``r`` is the case's documented status with the OpenAI error object; returns the error."""
    status, error_type = case.expected
    assert r.status_code == status, r.text[:2000]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert case.message.lower() in error["message"].lower(), error
    if case.param is not None:
        assert error["param"] == case.param, error
    return error
