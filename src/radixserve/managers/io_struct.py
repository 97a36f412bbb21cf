"""Every message that crosses a process boundary, grouped by direction, with one codec.

Messages are ``msgspec`` structs tagged by class name and encoded with msgpack. Nothing else is
ever sent between processes (never pickle).

    TokenizerManager ──▶ Scheduler:        TokenizedGenerateReqInput, TokenizedEmbeddingReqInput,
                                           AbortReq, FlushCacheReq, GetInternalStateReq,
                                           OpenSessionReqInput, CloseSessionReqInput, and the
                                           control requests (weights, memory, profiling,
                                           internal state, slow-down, GC, load, health,
                                           inspector): each ``*ReqInput``/``*Req`` below
    Scheduler ──▶ DetokenizerManager:      BatchTokenIDOutput
    DetokenizerManager ──▶ TokenizerManager: BatchStrOutput
    Scheduler ──▶ TokenizerManager:        BatchEmbeddingOutput (embeddings need no
                                           detokenizing), FlushCacheReqOutput,
                                           GetInternalStateReqOutput, OpenSessionReqOutput,
                                           one ``*Output`` per control request, and
                                           ControlErrorOutput when a control handler failed
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


class TokenizedEmbeddingReqInput(_Msg):
    """One input of an embedding model (an encoder, or a decoder run with --is-embedding)."""

    rid: str
    input_ids: list[int]
    input_text: str | None = None


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


class CloseSessionReqInput(_Msg):
    session_id: str


# The control requests; each is answered by the ``*Output`` of the same name.
class UpdateWeightFromDiskReqInput(_Msg):
    model_path: str
    load_format: str | None = None


class GetWeightsByNameReqInput(_Msg):
    name: str
    truncate_size: int = 100


class ReleaseMemoryOccupationReqInput(_Msg):
    tags: list[str] | None = None  # "kv_cache", "weights"; None: both


class ResumeMemoryOccupationReqInput(_Msg):
    tags: list[str] | None = None


class ProfileReq(_Msg):
    action: str  # "start" or "stop"
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None  # "CPU", "GPU"
    record_shapes: bool = False
    with_stack: bool = False


class SetInternalStateReq(_Msg):
    server_args: dict[str, Any]


class SlowDownReqInput(_Msg):
    forward_sleep_time: float | None  # seconds each forward step sleeps; None: back to normal


class FreezeGCReq(_Msg):
    pass


class GetLoadReqInput(_Msg):
    pass


class HealthCheckReq(_Msg):
    seq: int


class GetInspectorStateReq(_Msg):
    pass


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
class ReqEmbeddingOutput(msgspec.Struct, kw_only=True):
    """A finished embedding request: its pooled, normalised embedding (float32 values)."""

    rid: str
    embedding: list[float]
    finished_reason: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int


class BatchEmbeddingOutput(_Msg):
    outputs: list[ReqEmbeddingOutput]


class FlushCacheReqOutput(_Msg):
    success: bool
    message: str = ""


class GetInternalStateReqOutput(_Msg):
    state: dict[str, Any]


class OpenSessionReqOutput(_Msg):
    session_id: str | None
    success: bool
    message: str = ""


class UpdateWeightFromDiskReqOutput(_Msg):
    success: bool
    message: str


class GetWeightsByNameReqOutput(_Msg):
    parameter: list[Any] | None  # the first truncate_size rows (or values), as float lists
    message: str = ""


class ReleaseMemoryOccupationReqOutput(_Msg):
    success: bool
    message: str


class ResumeMemoryOccupationReqOutput(_Msg):
    success: bool
    message: str


class ProfileReqOutput(_Msg):
    success: bool
    message: str
    trace_path: str | None = None


class SetInternalStateReqOutput(_Msg):
    updated: bool
    message: str
    server_args: dict[str, Any]


class SlowDownReqOutput(_Msg):
    forward_sleep_time: float | None


class FreezeGCReqOutput(_Msg):
    frozen_objects: int


class GetLoadReqOutput(_Msg):
    dp_rank: int
    num_reqs: int  # running + waiting
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # KV slots in use (neither free nor evictable)
    max_total_num_tokens: int
    token_usage: float


class HealthCheckReqOutput(_Msg):
    seq: int


class GetInspectorStateReqOutput(_Msg):
    state: dict[str, Any]


class ControlErrorOutput(_Msg):
    """A control handler raised: the caller of ``request`` (a type name) gets the error."""

    request: str
    message: str


Message = Union[  # noqa: UP007 - msgspec needs a real Union object here
    TokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    OpenSessionReqInput,
    CloseSessionReqInput,
    UpdateWeightFromDiskReqInput,
    GetWeightsByNameReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    ProfileReq,
    SetInternalStateReq,
    SlowDownReqInput,
    FreezeGCReq,
    GetLoadReqInput,
    HealthCheckReq,
    GetInspectorStateReq,
    BatchTokenIDOutput,
    BatchStrOutput,
    BatchEmbeddingOutput,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    OpenSessionReqOutput,
    UpdateWeightFromDiskReqOutput,
    GetWeightsByNameReqOutput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqOutput,
    ProfileReqOutput,
    SetInternalStateReqOutput,
    SlowDownReqOutput,
    FreezeGCReqOutput,
    GetLoadReqOutput,
    HealthCheckReqOutput,
    GetInspectorStateReqOutput,
    ControlErrorOutput,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
