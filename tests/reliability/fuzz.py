"""Schemathesis against a running server's ``/openapi.json``: every operation, positive and
negative bodies, judged by the error contract (``server/errors.py``).

``fuzz_operation`` sends ``examples`` generated requests to one operation, one at a time, and
returns what broke the contract: a 5xx, a 4xx without the OpenAI error object (Ollama's
``{"error": message}`` on its ``/api/`` routes), a stream whose error event reports a server
error (any error line of an Ollama NDJSON stream), or no answer within ``CALL_TIMEOUT_S``.
It keeps going after a failure (the whole picture, not the first bug) and puts the server back
the way it was after each operator call that changes its state (pause, slow down, release
memory, profile, tuned limits), so that one operation's examples never break the next one's.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from radixserve.server.errors import ERROR_TYPES

CALL_TIMEOUT_S = 60.0
# Documented 5xx answers, not bugs: SGLang's fork-join route that radixserve does not implement.
EXPECTED_5XX = {("POST", "/concate_and_append_request"): 501,
                # Ollama's model management: the model is fixed at start
                **{("POST", f"/api/{r}"): 501 for r in ("pull", "push", "create", "copy")},
                ("DELETE", "/api/delete"): 501}


@dataclass
class OperationReport:
    """What one operation's fuzz sent and what broke the contract (one sample per kind)."""

    label: str
    calls: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    def fail(self, kind: str, detail: str) -> None:
        self.failures.setdefault(kind, detail)


# Numbers at and past the bounds a server must check (32 and 64 bits, signed and unsigned).
_EDGE_INTS = (-1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30)
_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 80), st.sampled_from(_EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
)
_VALUE = st.one_of(_SCALAR, st.lists(_SCALAR, max_size=3),
                   st.dictionaries(st.text(max_size=4), _SCALAR, max_size=2))
# The fields of SGLang's sampling parameters (native ``/generate``).
_SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "logit_bias", "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed",
    "stop_regex", "stream_interval", "regex", "json_schema", "n",
)


_SHORT = st.integers(0, 8)  # output tokens of a plausible request unless the fuzz sets them


def _plausible_chat(body: dict[str, Any], draw: Callable[[Any], Any]) -> None:
    body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=40))}]
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = draw(_SHORT)


def _plausible_generate(body: dict[str, Any], draw: Callable[[Any], Any]) -> None:
    body["text"] = draw(st.text(min_size=1, max_size=40))
    body.pop("input_ids", None)
    params = draw(st.dictionaries(st.sampled_from(_SAMPLING_KEYS), _VALUE, max_size=5))
    params.setdefault("max_new_tokens", draw(_SHORT))
    body["sampling_params"] = params


def _ollama_options(body: dict[str, Any], draw: Callable[[Any], Any]) -> None:
    options = body.get("options")
    body["options"] = options if isinstance(options, dict) else {}
    body["options"].setdefault("num_predict", draw(_SHORT))


def _plausible_ollama_chat(body: dict[str, Any], draw: Callable[[Any], Any]) -> None:
    body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=40))}]
    _ollama_options(body, draw)


def _plausible_ollama_generate(body: dict[str, Any], draw: Callable[[Any], Any]) -> None:
    body["prompt"] = draw(st.text(min_size=1, max_size=40))
    _ollama_options(body, draw)


# Bodies the schema alone rarely makes valid (a chat message's fields depend on its role; the
# native sampling parameters are an open dict): half of the positive examples get a valid core
# and keep their fuzzed fields, so that the fuzz reaches generation, not only validation.
PLAUSIBLE: dict[str, Callable[[dict[str, Any], Callable[[Any], Any]], None]] = {
    "/v1/chat/completions": _plausible_chat,
    "/generate": _plausible_generate,
    "/api/chat": _plausible_ollama_chat,  # Ollama's: these also get the served model's name
    "/api/generate": _plausible_ollama_generate,
}


def load_schema(base_url: str, headers: dict[str, str] | None = None) -> Any:
    raw = requests.get(f"{base_url}/openapi.json", headers=headers, timeout=CALL_TIMEOUT_S)
    raw.raise_for_status()
    schema = schemathesis.openapi.from_dict(raw.json())
    schema.config.update(base_url=base_url)
    return schema


def operations(schema: Any) -> list[Any]:
    """Every operation in the schema's order, or the part of them that
    ``RADIXSERVE_FUZZ_OPERATIONS`` (a comma-separated list of labels such as ``POST /generate``
    or bare paths, each path meaning all of its methods) and ``RADIXSERVE_FUZZ_AFTER`` (a label:
    only the operations after it, to go on from where a stopped run printed its last one)
    select. An entry that names no operation is an error, not an empty run."""
    ops = [result.ok() for result in schema.get_all_operations()]
    after = os.environ.get("RADIXSERVE_FUZZ_AFTER", "").strip()
    if after:
        labels = [label(op) for op in ops]
        if after not in labels:
            raise ValueError(f"RADIXSERVE_FUZZ_AFTER={after!r} is not an operation: {labels}")
        ops = ops[labels.index(after) + 1:]
    wanted = [w.strip() for w in os.environ.get("RADIXSERVE_FUZZ_OPERATIONS", "").split(",")]
    wanted = [w for w in wanted if w]
    if wanted:
        unknown = [w for w in wanted if not any(w in (label(op), op.path) for op in ops)]
        if unknown:
            raise ValueError(f"RADIXSERVE_FUZZ_OPERATIONS names no operation: {unknown}")
        ops = [op for op in ops if label(op) in wanted or op.path in wanted]
    return ops


def is_subset() -> bool:
    """Whether ``operations`` selects part of the schema (the checks of the whole are off)."""
    return bool(os.environ.get("RADIXSERVE_FUZZ_AFTER", "").strip()
                or os.environ.get("RADIXSERVE_FUZZ_OPERATIONS", "").strip())


def label(operation: Any) -> str:
    """``METHOD /path``, as the reports print it."""
    return f"{operation.method.upper()} {operation.path}"


def is_error_object(body: Any, path: str = "") -> bool:
    """The OpenAI error object; on Ollama's routes (``/api/``), Ollama's ``{"error": message}``."""
    error = body.get("error") if isinstance(body, dict) else None
    if path.startswith("/api/"):
        return isinstance(error, str) and bool(error)
    return (isinstance(error, dict) and isinstance(error.get("message"), str)
            and bool(error["message"]) and isinstance(error.get("type"), str))


# The error ``type`` of each 5xx (a Responses stream names its failure by type, not status).
SERVER_ERROR_TYPES = frozenset(t for status, t in ERROR_TYPES.items() if status >= 500)


def stream_server_errors(text: str) -> list[Any]:
    """The events of an SSE body that report a server error after the stream started: an
    ``error`` object without an int code below 500 (native and OpenAI chat/completions
    streams), or a Responses ``error`` event whose code is a 5xx's type."""
    found = []
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line.removeprefix("data: "))
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("type") == "error":  # Responses: then response.failed
            if event.get("code") in SERVER_ERROR_TYPES:
                found.append(event)
        elif "error" in event:
            error = event["error"]
            code = error.get("code") if isinstance(error, dict) else None
            if not isinstance(code, int) or code >= 500:
                found.append(error)
    return found


def judge(report: OperationReport, case: Any, response: requests.Response) -> None:
    """Record every way ``response`` breaks the error contract."""
    status = response.status_code
    report.statuses[status] = report.statuses.get(status, 0) + 1
    where = f"{case.method} {case.formatted_path} body={_short(case.body)}"
    if status >= 500 and EXPECTED_5XX.get((case.method, case.path)) != status:
        report.fail(f"{status}", f"{where} -> {status} {response.text[:300]}")
    if 400 <= status < 500:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not is_error_object(body, case.path):
            report.fail(f"{status} without an error object",
                        f"{where} -> {status} {response.text[:300]}")
    content_type = response.headers.get("content-type", "")
    if status == 200 and content_type.startswith("text/event-stream"):
        for error in stream_server_errors(response.text):
            report.fail("stream error event", f"{where} -> {error}")
    if status == 200 and content_type.startswith("application/x-ndjson"):
        # Ollama's streams: a request is refused before its first line (``prime``), so an
        # error line means the generation failed after it started.
        for line in response.text.splitlines():
            if line.startswith('{"error"'):
                report.fail("stream error line", f"{where} -> {line[:300]}")


def _short(body: Any, limit: int = 300) -> str:
    text = repr(body)
    return text if len(text) <= limit else text[:limit] + "..."


class ServerKeeper:
    """Puts the server back after an operator call that changed its state."""

    def __init__(self, base_url: str, session: requests.Session, profile_dir: str) -> None:
        self.base_url = base_url
        self.session = session
        self.profile_dir = profile_dir
        info = self._call("GET", "/get_server_info").json()
        self.tunables = {k: info[k] for k in ("max_running_requests", "max_prefill_tokens",
                                                "chunked_prefill_size")}
        self.tunables["max_running_requests"] = info["internal_states"][0]["max_running_requests"]
        self.model = self._call("GET", "/v1/models").json()["data"][0]["id"]
        self._undo: dict[str, Callable[[], None]] = {
            "/pause_generation": lambda: self._call("POST", "/continue_generation"),
            "/release_memory_occupation": lambda: self._call("POST", "/resume_memory_occupation"),
            "/slow_down": lambda: self._call("POST", "/slow_down",
                                             json={"forward_sleep_time": None}),
            "/start_profile": lambda: self._call("POST", "/stop_profile"),
            "/set_internal_state": lambda: self._call(
                "POST", "/set_internal_state",
                json={"server_args": {k: v for k, v in self.tunables.items() if v is not None}}),
        }

    def _call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """On a connection of its own: the fuzzed call may have left the shared one closed.
        A 4xx is fine (nothing to undo: the fuzzed call was refused); a 5xx is not."""
        response = requests.request(method, self.base_url + path, timeout=CALL_TIMEOUT_S,
                                    **kwargs)
        assert response.status_code < 500, f"{method} {path}: {response.text[:300]}"
        return response

    def send(self, case: Any) -> requests.Response:
        """Send ``case`` on the shared connection; NaN and infinity are sent as Python's JSON
        writes them (``requests`` refuses to), since a client can send them."""
        kwargs = case.as_transport_kwargs(base_url=self.base_url)
        if "json" in kwargs:
            kwargs["data"] = json.dumps(kwargs.pop("json")).encode()
            kwargs["headers"] = {**(kwargs.get("headers") or {}),
                                 "Content-Type": "application/json"}
        return self.session.request(**kwargs, timeout=CALL_TIMEOUT_S)

    def tame(self, case: Any, draw: Callable[[Any], Any]) -> Any:
        """Make a body plausible (``PLAUSIBLE``) when the draw says so; a profile is written
        where the test says, never to a path the fuzz made up."""
        body = case.body if isinstance(case.body, dict) else None
        if body is None:
            return case
        plausible = PLAUSIBLE.get(case.path)
        if plausible is not None and draw(st.booleans()):
            for name in draw(st.sets(st.sampled_from(sorted(body)))) if body else ():
                del body[name]  # fewer fuzzed fields: more of these reach generation
            body.pop("model", None)
            plausible(body, draw)
            if case.path.startswith("/api/"):  # Ollama's routes need the model named
                body["model"] = self.model
        if case.path == "/start_profile" and isinstance(body.get("output_dir"), str):
            body["output_dir"] = self.profile_dir
        return case

    def restore(self, case: Any) -> None:
        undo = self._undo.get(case.path)
        if undo is not None:
            undo()


def fuzz_operation(operation: Any, keeper: ServerKeeper, examples: int,
                   seed: int | None) -> OperationReport:
    """Send ``examples`` positive and negative requests to ``operation``; ``seed`` None: the
    same examples on every run (hypothesis' derandomized mode)."""
    report = OperationReport(label(operation))
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                         operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=examples, deadline=None, database=None,
              derandomize=seed is None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(case=strategy, data=st.data())
    def run(case: Any, data: st.DataObject) -> None:
        case = keeper.tame(case, data.draw)
        report.calls += 1
        try:
            response = keeper.send(case)
        except requests.RequestException as exc:
            report.fail("no answer", f"{case.method} {case.formatted_path} "
                        f"body={_short(case.body)}: {type(exc).__name__}: {exc}")
            return
        finally:
            keeper.restore(case)
        judge(report, case, response)

    if seed is not None:
        run = hypothesis.seed(seed)(run)
    run()
    return report


def examples_per_operation() -> int:
    """``RADIXSERVE_FUZZ_EXAMPLES`` (``make fuzz``), else CI's 30 (100 took five of the suite's
    40 minutes, 60 three, 45 two and a half; ``make fuzz`` is the deep run)."""
    return int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "30"))


def fuzz_seed() -> int | None:
    """None in CI (the same examples every run); ``RADIXSERVE_FUZZ_SEED`` replays a run;
    ``RADIXSERVE_FUZZ_RANDOM=1`` (``make fuzz``) draws a fresh seed, which the test prints."""
    if "RADIXSERVE_FUZZ_SEED" in os.environ:
        return int(os.environ["RADIXSERVE_FUZZ_SEED"])
    if os.environ.get("RADIXSERVE_FUZZ_RANDOM") == "1":
        return random.randrange(2**32)
    return None
