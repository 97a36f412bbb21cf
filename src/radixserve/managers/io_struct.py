"""Every message that crosses a process boundary, grouped by direction, with one codec.

Messages are ``msgspec`` structs tagged by class name and encoded with msgpack. Nothing else is
ever sent between processes (never pickle).

    TokenizerManager ──▶ Scheduler:        TokenizedGenerateReqInput, AbortReq, FlushCacheReq,
                                           GetInternalStateReq, OpenSessionReqInput,
                                           CloseSessionReqInput
    Scheduler ──▶ DetokenizerManager:      BatchTokenIDOutput
    DetokenizerManager ──▶ TokenizerManager: BatchStrOutput
    Scheduler ──▶ TokenizerManager:        FlushCacheReqOutput, GetInternalStateReqOutput,
                                           OpenSessionReqOutput
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from radixserve.sampling.sampling_params import SamplingParams


class _Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of all IPC messages; the tag is the class name."""


# ---------------------------------------------------------------- tokenizer -> scheduler
class SessionParams(msgspec.Struct, kw_only=True):
    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class TokenizedGenerateReqInput(_Msg):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    session_params: SessionParams | None = None


class AbortReq(_Msg):
    rid: str = ""
    abort_all: bool = False


class FlushCacheReq(_Msg):
    pass


class GetInternalStateReq(_Msg):
    pass


class OpenSessionReqInput(_Msg):
    capacity_of_str_len: int
    session_id: str | None = None
    streaming: bool = False
    timeout: float | None = None
    resume: bool = False  # continue the stored streaming session ``session_id`` (restart)


class CloseSessionReqInput(_Msg):
    session_id: str


# ---------------------------------------------------------------- scheduler -> detokenizer
class ReqTokenOutput(msgspec.Struct, kw_only=True):
    """One request's progress since its previous output.

    ``finished_reason`` is ``None`` while running, else a dict like SGLang's:
    ``{"type": "stop", "matched": <token id or stop string>}``, ``{"type": "length",
    "length": n}`` or ``{"type": "abort", "message": str}``.
    """

    rid: str
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stream: bool = False
    stop: list[str] = msgspec.field(default_factory=list)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Present when the request asked for logprobs; one entry per new token.
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None


class BatchTokenIDOutput(_Msg):
    outputs: list[ReqTokenOutput]


# ---------------------------------------------------------------- detokenizer -> tokenizer
class ReqStrOutput(msgspec.Struct, kw_only=True):
    """One request's new text (a delta, UTF-8 safe, stop strings trimmed) and new tokens."""

    rid: str
    new_text: str
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None


class BatchStrOutput(_Msg):
    outputs: list[ReqStrOutput]


# ---------------------------------------------------------------- scheduler -> tokenizer
class FlushCacheReqOutput(_Msg):
    success: bool
    message: str = ""


class GetInternalStateReqOutput(_Msg):
    state: dict[str, Any]


class OpenSessionReqOutput(_Msg):
    session_id: str | None
    success: bool
    message: str = ""


Message = Union[  # noqa: UP007 - msgspec needs a real Union object here
    TokenizedGenerateReqInput,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    OpenSessionReqInput,
    CloseSessionReqInput,
    BatchTokenIDOutput,
    BatchStrOutput,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    OpenSessionReqOutput,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
