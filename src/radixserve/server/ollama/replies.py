"""Ollama's replies to ``/api/chat`` and ``/api/generate``: one JSON object, or NDJSON lines.

Both endpoints answer the same way and differ only in where the text goes (``Turn.kind``): chat
puts it in ``message`` (``content``, ``thinking``, ``tool_calls``), generate in ``response`` and
``thinking`` and adds ``context`` (prompt and output token ids, which a client sends back to
continue). A stream sends a line per new piece of text with ``done: false``, then one line
with ``done: true``, ``done_reason`` and the counts and durations; tool calls come whole (their
arguments an object, as Ollama sends them), in the last line. A failure after the stream
started is a last line ``{"error": ...}``, which Ollama's clients raise.

Durations are measured here, in nanoseconds as Ollama gives them: ``prompt_eval_duration`` from
the request to its first output, ``eval_duration`` from there to the last; ``load_duration``
is 0 (the model is loaded once, at start).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from radixserve.server.context import ServerContext
from radixserve.server.errors import stream_error
from radixserve.server.generations import cancel_on_disconnect, prime
from radixserve.server.openai.chat_parsing import ChoiceParser
from radixserve.server.openai.tool_parsers import ToolCall

NDJSON = "application/x-ndjson"


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def done_reply(ctx: ServerContext, kind: Literal["chat", "generate"], reason: str
               ) -> dict[str, Any]:
    """The reply to a request with nothing to generate: Ollama's ``load`` (an empty prompt
    loads the model; here it is always loaded)."""
    reply: dict[str, Any] = {"model": ctx.model_name, "created_at": created_at()}
    if kind == "chat":
        reply["message"] = {"role": "assistant", "content": ""}
    else:
        reply["response"] = ""
    return {**reply, "done": True, "done_reason": reason}


def tool_call_object(call: ToolCall, index: int) -> dict[str, Any]:
    """One call as Ollama sends it: the arguments decoded into an object."""
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"the model's call of {call.name} has arguments that are not JSON: "
                         f"{e}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the model's call of {call.name} has arguments that are not a JSON "
                         "object")
    return {"function": {"index": index, "name": call.name, "arguments": arguments}}


@dataclass
class Turn:
    """One ``/api/chat`` or ``/api/generate`` generation and what its reply needs."""

    ctx: ServerContext
    kind: Literal["chat", "generate"]
    parser: ChoiceParser
    prompt_ids: list[int]
    logprobs: bool
    started_ns: int = field(default_factory=time.perf_counter_ns)
    first_output_ns: int | None = None

    def _body(self, content: str, thinking: str | None, calls: list[dict[str, Any]]
              ) -> dict[str, Any]:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"message": message}
        body: dict[str, Any] = {"response": content}
        if thinking:
            body["thinking"] = thinking
        return body

    def _line(self, body: dict[str, Any], done: bool) -> dict[str, Any]:
        return {"model": self.ctx.model_name, "created_at": created_at(), **body, "done": done}

    def _logprobs(self, meta: dict[str, Any], start: int = 0) -> list[dict[str, Any]]:
        """Ollama's logprobs of the output tokens from index ``start`` on."""
        tok = self.ctx.tokenizer

        def entry(lp: float, tid: int) -> dict[str, Any]:
            text = tok.decode([tid])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        tops = meta.get("output_top_logprobs") or []
        out = []
        for k, (lp, tid, _) in enumerate(meta.get("output_token_logprobs", [])[start:]):
            item = entry(lp, tid)
            top = (tops[start + k] if start + k < len(tops) else None) or []
            item["top_logprobs"] = [entry(t_lp, t_id) for t_lp, t_id, _ in top]
            out.append(item)
        return out

    def _final_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """What the last object adds: why it stopped, the counts, the durations."""
        meta = out["meta_info"]
        now = time.perf_counter_ns()
        first = self.first_output_ns or now
        reason = meta["finish_reason"] or {}
        fields = {
            "done_reason": str(reason.get("type", "stop")),
            "total_duration": now - self.started_ns,
            "load_duration": 0,
            "prompt_eval_count": meta["prompt_tokens"],
            "prompt_eval_duration": first - self.started_ns,
            "eval_count": meta["completion_tokens"],
            "eval_duration": now - first,
        }
        if self.kind == "generate":
            fields["context"] = [*self.prompt_ids, *out["output_ids"]]
        return fields

    def whole(self, out: dict[str, Any]) -> dict[str, Any]:
        """The reply to a request that does not stream, from its finished output."""
        parsed = self.parser.final(out["text"])
        calls = [tool_call_object(c, i) for i, c in enumerate(parsed.calls)]
        reply = self._line(self._body(parsed.content or "", parsed.reasoning, calls), True)
        if self.logprobs:
            reply["logprobs"] = self._logprobs(out["meta_info"])
        return {**reply, **self._final_fields(out)}

    async def lines(self, outputs: AsyncIterator[tuple[int, dict[str, Any]]]
                    ) -> AsyncIterator[bytes]:
        """NDJSON lines for the cumulative outputs of the one generation."""
        text_sent = tokens_sent = 0
        calls: dict[int, list[str]] = {}  # index → [name, arguments so far]
        async with contextlib.aclosing(outputs):  # type: ignore[type-var]
            try:
                async for _, out in outputs:
                    if self.first_output_ns is None:
                        self.first_output_ns = time.perf_counter_ns()
                    new_text = out["text"][text_sent:]
                    text_sent = len(out["text"])
                    done = out["meta_info"]["finish_reason"] is not None
                    delta = self.parser.stream(new_text, done)
                    for c in delta.calls:
                        entry = calls.setdefault(c.index, ["", ""])
                        entry[0] = c.name or entry[0]
                        entry[1] += c.arguments
                    logprobs = (self._logprobs(out["meta_info"], tokens_sent)
                                if self.logprobs else [])
                    tokens_sent = len(out["output_ids"])
                    if not done and not (delta.content or delta.reasoning or logprobs):
                        continue
                    whole_calls = [tool_call_object(ToolCall(name, args), i)
                                   for i, (name, args) in sorted(calls.items())] if done else []
                    line = self._line(self._body(delta.content, delta.reasoning, whole_calls),
                                      done)
                    if self.logprobs:
                        line["logprobs"] = logprobs
                    if done:
                        line.update(self._final_fields(out))
                    yield _ndjson(line)
            except Exception as exc:
                yield _ndjson({"error": stream_error(exc)["error"]["message"]})

    async def _last(self, outputs: AsyncIterator[tuple[int, dict[str, Any]]]
                    ) -> dict[str, Any]:
        """The finished output (the generation streams internally, so that the time of its
        first output is known)."""
        last = None
        async with contextlib.aclosing(outputs):  # type: ignore[type-var]
            async for _, out in outputs:
                if self.first_output_ns is None:
                    self.first_output_ns = time.perf_counter_ns()
                last = out
        if last is None:
            raise RuntimeError("the generation ended without output")
        return last

    async def send(self, request: Request, outputs: AsyncIterator[tuple[int, dict[str, Any]]],
                   stream: bool) -> Response:
        """The whole reply, or the NDJSON stream, primed so that a request the
        TokenizerManager refuses fails with its status before anything is sent."""
        if not stream:
            out = await cancel_on_disconnect(request, self._last(outputs))
            return JSONResponse(self.whole(out))
        first = await prime(request, outputs)
        return StreamingResponse(self.lines(first), media_type=NDJSON)


def _ndjson(obj: dict[str, Any]) -> bytes:
    """One line. ASCII-escaped: generated text may hold U+2028 and the like, which line readers
    (httpx's ``iter_lines``, which Ollama's client reads with) take for line breaks."""
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()
