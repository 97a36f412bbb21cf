"""The HTTP edge against slow and malformed clients, and the keys: a real server, raw sockets.

The slow-client tests synchronise on the server closing the connection (``recv`` returning
nothing), never on a sleep: the client sends part of a request and waits for the server's
answer; the socket timeout only bounds a failure.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest

from radixserve.cli import build_parser, server_args_from_namespace
from radixserve.server.request_guard import MAX_HEAD_BUFFER
from tests.server.conftest import assert_no_leak, start_server

READ_TIMEOUT_S = 2.0
KEY = "edge-key-from-a-file"
ADMIN_KEY = "edge-admin-key-from-the-environment"
FAILURE_BOUND_S = 120.0


@pytest.fixture(scope="module")
def edge(llama_path, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-key"
    key_file.write_text(KEY + "\n")
    srv = start_server(
        llama_path, "--request-read-timeout", str(READ_TIMEOUT_S), "--api-key-file",
        str(key_file), env={"RADIXSERVE_ADMIN_API_KEY": ADMIN_KEY},
    )
    yield srv
    srv.check_clean_stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def exchange(server, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection, then read until the server closes it; returns what
    it answered and how long after sending it closed."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(FAILURE_BOUND_S)
        start = time.monotonic()
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received, time.monotonic() - start


def parse(response: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_error_object(body: dict, error_type: str, message: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert message in error["message"], error


def test_headers_that_never_end_get_408_and_the_connection_closed(edge):
    answer, elapsed = exchange(edge, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Ty")
    status, headers, body = parse(answer)
    assert status == 408 and headers["connection"] == "close"
    assert_error_object(body, "request_timeout", "request headers did not arrive within 2s")
    assert elapsed >= READ_TIMEOUT_S * 0.9  # the deadline, not an early cut


def test_a_connection_that_sends_nothing_is_closed(edge):
    answer, elapsed = exchange(edge, b"")
    assert answer == b""
    assert elapsed >= READ_TIMEOUT_S * 0.9


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closed(edge):
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    answer, _ = exchange(edge, head + b'{"text": "hi"')
    status, headers, body = parse(answer)
    assert status == 408 and headers["connection"] == "close"
    assert_error_object(body, "request_timeout", "13 of 100 bytes were received")
    with httpx.Client(base_url=edge.base_url, headers=auth()) as client:
        assert_no_leak(client)


def test_a_kept_alive_connection_has_the_same_deadline_for_its_next_request(edge):
    answer, _ = exchange(edge, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")
    first, _, rest = answer.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    assert parse(rest)[0] == 408


@pytest.mark.parametrize(
    ("content_length", "reason"),
    [(b"Content-Length: abc", "bad Content-Length"),
     (b"Content-Length: -5", "bad Content-Length"),
     (b"Content-Length: 2\r\nContent-Length: 3", "conflicting Content-Length")],
    ids=["not_a_number", "negative", "two_different"],
)
def test_a_malformed_content_length_gets_the_error_object(edge, content_length, reason):
    answer, elapsed = exchange(edge, b"POST /generate HTTP/1.1\r\nHost: x\r\n" + content_length
                               + b"\r\n\r\n{}")
    status, headers, body = parse(answer)
    assert status == 400 and headers["connection"] == "close"
    assert_error_object(body, "invalid_request_error", f"not valid HTTP/1.1: {reason}")
    assert elapsed < READ_TIMEOUT_S  # answered at once, not at the read deadline


def test_a_head_that_outgrows_the_buffer_unfinished_gets_431_at_once(edge):
    # One byte past h11's buffer and no blank line: h11, not the guard, refuses it, and only
    # once every byte sent has been read (so the close cannot reset an unread tail).
    start = b"POST /generate HTTP/1.1\r\nHost: x\r\nx-big: "
    answer, elapsed = exchange(edge, start + b"a" * (MAX_HEAD_BUFFER + 1 - len(start)))
    status, headers, body = parse(answer)
    assert status == 431 and headers["connection"] == "close"
    assert_error_object(body, "request_too_large", f"more than {MAX_HEAD_BUFFER} bytes long")
    assert elapsed < READ_TIMEOUT_S


def test_requests_on_time_are_served_while_a_slow_client_is_held(edge):
    with socket.create_connection(("127.0.0.1", edge.port)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        with httpx.Client(base_url=edge.base_url, headers=auth(), timeout=60) as client:
            r = client.post("/generate", json={"text": "hi",
                                               "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text


def test_two_authorization_headers_are_refused_even_when_both_are_right(edge):
    with httpx.Client(base_url=edge.base_url) as client:
        headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")]
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401
        assert_error_object(r.json(), "authentication_error", "More than one Authorization")
        mixed = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")]
        assert client.get("/v1/models", headers=mixed).status_code == 401
        assert client.get("/v1/models", headers=auth()).status_code == 200


def test_keys_from_a_file_and_the_environment_work_and_show_nowhere(edge):
    with httpx.Client(base_url=edge.base_url) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=auth()).status_code == 200
        # the admin key (from RADIXSERVE_ADMIN_API_KEY) guards the operator routes
        assert client.post("/flush_cache", headers=auth()).status_code == 401
        assert client.post("/flush_cache", headers=auth(ADMIN_KEY)).status_code == 200
        info = client.get("/get_server_info", headers=auth()).json()
    assert "api_key" not in info and "admin_api_key" not in info
    assert KEY not in json.dumps(info) and ADMIN_KEY not in json.dumps(info)
    for proc in [psutil.Process(edge.proc.pid), *edge.children()]:
        assert not {KEY, ADMIN_KEY} & set(" ".join(proc.cmdline()).split())


def test_health_generate_says_what_failed(edge):
    admin = auth(ADMIN_KEY)
    with httpx.Client(base_url=edge.base_url, headers=admin, timeout=60) as client:
        assert client.get("/health_generate").status_code == 200
        assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).is_success
        try:
            r = client.get("/health_generate")
        finally:
            assert client.post("/resume_memory_occupation",
                               json={"tags": ["kv_cache"]}).is_success
        assert r.status_code == 503
        assert_error_object(r.json(), "service_unavailable_error",
                            "health generation failed: the server's memory is released")
        assert client.get("/health_generate").status_code == 200


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-key", "a", "--api-key-file", "f"], "not both"),
        (["--admin-api-key-file", "/no/such/file"], "cannot read /no/such/file"),
    ],
)
def test_key_flags_that_contradict_or_cannot_be_read_are_errors(argv, message):
    ns = build_parser().parse_args(["serve", "--model-path", "m", *argv])
    with pytest.raises(ValueError, match=message):
        server_args_from_namespace(ns)


def test_key_precedence_flag_then_file_then_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    monkeypatch.setenv("RADIXSERVE_ADMIN_API_KEY", "admin-from-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")

    def keys(*argv: str) -> tuple[str | None, str | None]:
        args = server_args_from_namespace(
            build_parser().parse_args(["serve", "--model-path", "m", *argv]))
        return args.api_key, args.admin_api_key

    assert keys() == ("from-env", "admin-from-env")
    assert keys("--api-key-file", str(key_file)) == ("from-file", "admin-from-env")
    assert keys("--api-key", "from-flag", "--admin-api-key", "x") == ("from-flag", "x")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        keys("--api-key-file", str(tmp_path / "empty"))
