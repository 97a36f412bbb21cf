"""Ollama's request bodies, and how their ``options`` become radixserve's sampling parameters.

As on the other APIs nothing is dropped: a field is honoured, accepted because it has no
effect here by nature (``keep_alive``: the one model stays loaded), or refused with a 400 naming
it (``StrictRequest``'s ``UNSUPPORTED``, with the values that mean "not used"). docs/ollama.md
has the table.

Options map to SGLang's sampling parameters by meaning: ``num_predict`` → ``max_new_tokens``
(-1 and -2: up to the end of the context), ``repeat_penalty`` → ``repetition_penalty``, the rest
by their own names. ``num_ctx`` is the request's context window: it may not exceed the model's
context length (radixserve does not resize the context per request), the prompt must fit in it
and generation stops at its end. ``top_k`` 0 (or less) means the whole vocabulary, as in
llama.cpp. An option left out takes radixserve's default, as on the OpenAI API (temperature 1,
no top-p, top-k or penalty), not the defaults of an Ollama Modelfile.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from radixserve.server.errors import APIError
from radixserve.server.openai.structured_outputs import ANY_JSON_OBJECT, json_schema_params
from radixserve.server.sampling_fields import SamplingFields
from radixserve.server.strict_request import StrictRequest, Unsupported

_LOAD_TIME = "a load-time setting of Ollama's runner; radixserve's are its server flags"
_MIROSTAT = "Mirostat sampling is not supported"

UNSUPPORTED_OPTIONS: Unsupported = {
    **{name: ((None,), _LOAD_TIME) for name in (
        "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
        "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread",
    )},
    "num_keep": ((None,), "the context is not shifted: a prompt that does not fit is refused"),
    "tfs_z": ((None, 1.0), "tail-free sampling is not supported"),
    "typical_p": ((None, 1.0), "locally typical sampling is not supported"),
    "mirostat": ((None, 0), _MIROSTAT),
    "mirostat_tau": ((None,), _MIROSTAT),
    "mirostat_eta": ((None,), _MIROSTAT),
    "penalize_newline": ((None,), "removed from Ollama; newlines are penalised like any token"),
    "repeat_last_n": ((None, -1), "the repetition penalty covers the whole context "
                                  "(repeat_last_n -1); a shorter window is not supported"),
}


class Options(SamplingFields):
    """Ollama's ``options`` (runtime options; the load-time ones are refused); ``top_k``,
    ``top_p``, ``min_p``, ``stop`` and the presence and frequency penalties come from
    ``SamplingFields``."""

    UNSUPPORTED = UNSUPPORTED_OPTIONS

    num_ctx: int | None = Field(default=None, ge=1)
    num_predict: int | None = Field(default=None, ge=-2)
    temperature: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None


# Go's time.ParseDuration, which Ollama reads a string keep_alive with: signed, a unit per number.
_GO_DURATION = re.compile(r"[-+]?(0|((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+)")


class OllamaRequest(StrictRequest):
    """What every Ollama model request names: the model, and how long to keep it loaded."""

    model: str = Field(min_length=1)
    # The one model stays loaded for the server's life: any duration is honoured by that, but
    # what Ollama could not read as one (Go's duration syntax, or seconds) is its 400 here too.
    keep_alive: float | str | None = None

    @field_validator("keep_alive")
    @classmethod
    def _a_duration(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, str) and not _GO_DURATION.fullmatch(value):
            raise ValueError(f"keep_alive must be a duration such as \"5m\" or \"1h30m\", or "
                             f"a number of seconds; got {value!r}")
        return value


class GenerationRequest(OllamaRequest):
    """Fields shared by ``/api/chat`` and ``/api/generate``. Ollama streams by default."""

    stream: bool = True
    options: Options | None = None
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def grammar(self) -> dict[str, str]:
        """``format``: ``"json"`` is any JSON object, a dict is a JSON schema."""
        if not self.format:
            return {}
        return {"json_schema": ANY_JSON_OBJECT} if self.format == "json" \
            else json_schema_params(self.format)

    def thinking_switch(self) -> bool | None:
        """``think`` as the chat template's ``enable_thinking`` (None: the template's default)."""
        if isinstance(self.think, str):
            raise APIError(400, f"think levels ({self.think!r}) are not supported; use true or "
                           "false", param="think")
        return self.think

    def sampling_params(self, prompt_len: int, context_len: int,
                        max_completion_tokens: int) -> dict[str, Any]:
        """The ``SamplingParams`` dict of this request for a prompt of ``prompt_len`` tokens."""
        o = self.options or Options()
        window = context_len
        if o.num_ctx is not None:
            if o.num_ctx > context_len:
                raise APIError(
                    400, f"options.num_ctx is {o.num_ctx}: this model's context length is "
                    f"{context_len} tokens (radixserve does not resize the context)",
                    param="options.num_ctx",
                )
            if prompt_len >= o.num_ctx:
                raise APIError(
                    400, f"the prompt has {prompt_len} tokens and options.num_ctx is "
                    f"{o.num_ctx}: the prompt does not fit (it is not truncated)",
                    param="options.num_ctx",
                )
            window = o.num_ctx
        rest = min(max(window - prompt_len, 0), max_completion_tokens)
        max_new = rest if o.num_predict is None or o.num_predict < 0 else min(o.num_predict, rest)
        if o.num_predict is not None and o.num_predict > max_completion_tokens:
            raise APIError(
                400, f"options.num_predict is {o.num_predict}: at most {max_completion_tokens} "
                "(--max-completion-tokens)", param="options.num_predict",
            )
        params: dict[str, Any] = {"max_new_tokens": max_new, **self.grammar()}
        optional = {
            "temperature": o.temperature,
            "top_k": -1 if o.top_k is not None and o.top_k <= 0 else o.top_k,
            "top_p": o.top_p,
            "min_p": o.min_p,
            "stop": o.stop,
            "repetition_penalty": o.repeat_penalty,
            "presence_penalty": o.presence_penalty,
            "frequency_penalty": o.frequency_penalty,
            "sampling_seed": o.seed,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        return params


# ---------------------------------------------------------------------------- /api/chat
class ToolCallFunction(StrictRequest):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # Ollama's newer replies number the calls; order says the same


class ToolCall(StrictRequest):
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Message(StrictRequest):
    UNSUPPORTED = {"images": ((None, []), "images are not supported: the model reads text")}

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # assistant messages: the reasoning the model wrote
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # tool messages: the function whose result this is
    tool_call_id: str | None = None  # tool messages (newer clients): the call it answers


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


# ---------------------------------------------------------------------------- /api/generate
class GenerateRequest(GenerationRequest):
    UNSUPPORTED = {
        "suffix": ((None, ""), "fill-in-the-middle (suffix) is not supported"),
        "template": ((None, ""), "Ollama's Go templates are not supported; the model's chat "
                                 "template is used, or none with raw"),
        "images": ((None, []), "images are not supported: the model reads text"),
        "width": ((None,), "image generation is not supported"),
        "height": ((None,), "image generation is not supported"),
        "steps": ((None,), "image generation is not supported"),
    }

    prompt: str | None = None
    system: str | None = None
    context: list[int] | None = None  # the token ids a previous reply returned
    raw: bool = False


# ---------------------------------------------------------------------------- others
class EmbedRequest(OllamaRequest):
    input: str | list[str]
    truncate: bool = True
    options: Options | None = None
    dimensions: int | None = None


class ShowRequest(StrictRequest):
    model: str | None = None
    name: str | None = None  # the older clients' name of ``model``
    verbose: bool = False
