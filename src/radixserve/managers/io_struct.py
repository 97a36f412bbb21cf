"""Every message that crosses a process boundary, grouped by direction, with one codec.

Messages are ``msgspec`` structs tagged by class name and encoded with msgpack. Nothing else is
ever sent between processes (never pickle).

    TokenizerManager ──▶ Scheduler:        TokenizedGenerateReqInput, TokenizedEmbeddingReqInput,
                                           AbortReq, FlushCacheReq, GetInternalStateReq,
                                           OpenSessionReqInput, CloseSessionReqInput, and the
                                           control requests (pause/continue, weights, memory,
                                           profiling, internal state, slow-down, GC, load,
                                           health, inspector): each ``*ReqInput``/``*Req``
    Scheduler ──▶ DetokenizerManager:      BatchTokenIDOutput
    DetokenizerManager ──▶ TokenizerManager: BatchStrOutput
    Scheduler ──▶ TokenizerManager:        BatchEmbeddingOutput (embeddings need no
                                           detokenizing), FlushCacheReqOutput,
                                           GetInternalStateReqOutput, OpenSessionReqOutput,
                                           one ``*Output`` per control request, and
                                           ControlErrorOutput when a control handler failed
    Scheduler ──▶ DataParallelController:  LoadReport
    scheduler rank ──▶ scheduler rank:     a list of the tokenizer's messages (encode_batch),
                                           StageResult (pipeline: sampled tokens of a step)
"""

from __future__ import annotations

from typing import Any, Literal, Union, get_args

import msgspec

from radixserve.finish_reason import FinishReason
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.sessions.session_params import SessionParams


class _Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of all IPC messages; the tag is the class name."""


# ---------------------------------------------------------------- tokenizer -> scheduler
class TokenizedGenerateReqInput(_Msg):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    return_logprob: bool = False
    # First prompt position with a returned logprob; -1: output logprobs only.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    session_params: SessionParams | None = None
    lora_path: str | None = None  # the LoRA adapter's name; None: the base model
    # The replica the data-parallel controller sends it to (None: its policy decides).
    data_parallel_rank: int | None = None
    # Its priority (--enable-priority-scheduling; None: --default-priority-value, else the
    # least important value).
    priority: int | None = None


# The per-prompt options that travel unchanged, under these names, from the caller's
# ``GenerateReqInput`` through ``TokenizedGenerateReqInput`` into the scheduler's ``Req``.
PER_PROMPT_OPTIONS = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "stream"
)


def per_prompt_options(obj: Any) -> dict[str, Any]:
    """``obj``'s ``PER_PROMPT_OPTIONS``, as keyword arguments for the next stage's constructor."""
    return {name: getattr(obj, name) for name in PER_PROMPT_OPTIONS}


class TokenizedEmbeddingReqInput(_Msg):
    """One input of an embedding model (an encoder, or a decoder run with --is-embedding)."""

    rid: str
    input_ids: list[int]
    input_text: str | None = None
    # A cross-encoder's segment of each token (pairs); None: segment 0 throughout.
    token_type_ids: list[int] | None = None


class AbortReq(_Msg):
    rid: str = ""
    abort_all: bool = False
    # How a waiting request it hits ends (default: "aborted by request", no status): a 503
    # for one evicted by a more important request (docs/priority.md).
    message: str = ""
    status_code: int | None = None


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


# The control requests; each is answered by the ``*Output`` of the same name.
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


class PauseGenerationReqInput(_Msg):
    """Stop running batches until ``ContinueGenerationReqInput`` (SGLang's modes).

    ``abort``: every waiting and running request is aborted. ``retract``: running requests go
    back to the waiting queue (their KV to the prefix cache; they re-prefill after the
    continue). ``in_place``: requests keep their KV and resume where they stopped. In every mode
    new requests queue up, and aborts, sessions and internal state are still handled.
    """

    mode: PauseMode = "abort"


class ContinueGenerationReqInput(_Msg):
    pass


class UpdateWeightFromDiskReqInput(_Msg):
    model_path: str
    load_format: str | None = None


class LoadLoRAAdapterReqInput(_Msg):
    """Load the PEFT adapter folder ``lora_path`` under ``lora_name`` (SGLang's names)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterReqInput(_Msg):
    lora_name: str


class InitWeightsUpdateGroupReqInput(_Msg):
    """Join a weights update group with an RL trainer (SGLang's fields; ``weight_sync.py``).
    ``backend`` None: the device's (gloo on CPU, nccl on CUDA)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str | None = None


class UpdateWeightsFromDistributedReqInput(_Msg):
    """Receive one broadcast per (name, dtype, shape) from rank 0 of ``group_name``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True


class UpdateWeightsFromTensorReqInput(_Msg):
    """Tensors in the shared-memory block ``shm_name``: (name, dtype, shape, byte offset)."""

    shm_name: str
    layout: list[tuple[str, str, list[int], int]]
    flush_cache: bool = True


class DestroyWeightsUpdateGroupReqInput(_Msg):
    group_name: str = "weight_update_group"


class GetWeightsByNameReqInput(_Msg):
    name: str
    truncate_size: int = 100


class ReleaseMemoryOccupationReqInput(_Msg):
    tags: list[str] | None = None  # "kv_cache", "weights"; None: both


class ResumeMemoryOccupationReqInput(_Msg):
    tags: list[str] | None = None


# Steps one profiling session may record (``num_steps``, and an open-ended session's bound):
# SGLang's profiles take 5-10; 200 steps of a small model write in seconds, a pause every request
# sees since the trace is written on the scheduler's thread.
MAX_PROFILE_STEPS = 200


class ProfileReq(_Msg):
    action: str  # "start" or "stop"
    output_dir: str | None = None
    num_steps: int | None = None  # at most MAX_PROFILE_STEPS
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
TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


class LogprobsOutput(msgspec.Struct, kw_only=True):
    """Logprobs of one report of a request that asked for them (``return_logprob``).

    ``output_*`` have one entry per new output token of the report. ``input_*`` come once, in
    the first report after the prompt was computed: one entry per prompt position from
    ``logprob_start_len`` on (``input_token_ids``), each the logprob of that token given the
    tokens before it, None for position 0 (nothing precedes it). ``*_top`` are present with
    ``top_logprobs_num``; ``*_token_ids`` (the logprobs of the request's ``token_ids_logprob``
    at each position) with that option.
    """

    output: list[float] = msgspec.field(default_factory=list)
    output_top: list[TopLogprobs] | None = None
    output_token_ids: list[list[float]] | None = None
    input_token_ids: list[int] | None = None
    input: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_token_ids_logprobs: list[list[float] | None] | None = None


class ReqProgress(msgspec.Struct, kw_only=True):
    """What a request's output carries on both hops (scheduler -> detokenizer -> tokenizer):
    its progress since its previous output.

    ``finished_reason`` is ``None`` while running, else why it ended (``finish_reason.py``).
    """

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # hierarchical cache: {"device", "host", "storage"} tokens of cached_tokens; else None
    cached_tokens_details: dict[str, int] | None = None
    logprobs: LogprobsOutput | None = None  # present when the request asked for logprobs


class ReqTokenOutput(ReqProgress, kw_only=True):
    """A request's progress with the options the detokenizer needs to turn it into text."""

    stream: bool = False
    stop: list[str] = msgspec.field(default_factory=list)
    stop_regex: list[str] = msgspec.field(default_factory=list)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class BatchTokenIDOutput(_Msg):
    outputs: list[ReqTokenOutput]


# ---------------------------------------------------------------- detokenizer -> tokenizer
class ReqStrOutput(ReqProgress, kw_only=True):
    """A request's progress with its new text (a delta, UTF-8 safe, stop strings trimmed)."""

    new_text: str

    @classmethod
    def from_token_output(cls, out: ReqTokenOutput, new_text: str) -> ReqStrOutput:
        """``out`` with its new text: every ``ReqProgress`` field passed on as it is (the
        detokenizer's options stay behind), so that a field added there travels without
        another line here."""
        passed_on = {name: getattr(out, name) for name in ReqProgress.__struct_fields__}
        return cls(new_text=new_text, **passed_on)


class BatchStrOutput(_Msg):
    outputs: list[ReqStrOutput]


# ---------------------------------------------------------------- scheduler -> tokenizer
class ReqEmbeddingOutput(msgspec.Struct, kw_only=True):
    """A finished embedding request: its pooled, normalised embedding (float32 values)."""

    rid: str
    embedding: list[float]
    finished_reason: FinishReason
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
    at_capacity: bool = False  # refused because --max-sessions sessions are open (HTTP 429)


class PauseGenerationReqOutput(_Msg):
    """Sent once the pause holds: no step is in flight and the mode's work is done."""

    num_aborted: int = 0
    num_retracted: int = 0


class ContinueGenerationReqOutput(_Msg):
    pass


class UpdateWeightFromDiskReqOutput(_Msg):
    success: bool
    message: str


class LoRAUpdateOutput(_Msg):
    """The reply to a LoRA load or unload: the adapters loaded afterwards, name → path."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = {}


class WeightsUpdateReqOutput(_Msg):
    """The reply to the weight-sync requests (init, update from distributed or tensors,
    destroy)."""

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


# ---------------------------------------------------------------- scheduler -> dp controller
class LoadReport(_Msg):
    """A replica's load, sent by its first rank whenever it changes (``shortest_queue``).

    ``num_received`` counts the generate requests the replica has received so far: the
    controller adds those it sent since then, which the report cannot know about yet.
    """

    dp_rank: int
    num_reqs: int  # running + waiting
    num_waiting_reqs: int
    num_tokens: int  # KV tokens in use
    num_received: int


# ---------------------------------------------------------------- scheduler rank -> rank
class StageInputLogprobs(_Msg):
    """``sampler.InputLogprobs`` of one request, on its way round the pipeline."""

    values: list[float]
    top: list[list[tuple[int, float]]] | None = None
    token_ids: list[list[float]] | None = None


class StageResult(_Msg):
    """Pipeline parallelism: what the last stage sampled for one micro-batch, handed round the
    stages so that each processes the step's outcome (identically) before scheduling the next."""

    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_ids_logprobs: list[list[float] | None] | None = None
    input_logprobs: list[StageInputLogprobs] | None = None


Message = Union[  # noqa: UP007 - msgspec needs a real Union object here
    TokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    OpenSessionReqInput,
    CloseSessionReqInput,
    PauseGenerationReqInput,
    ContinueGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    DestroyWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput,
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
    PauseGenerationReqOutput,
    ContinueGenerationReqOutput,
    UpdateWeightFromDiskReqOutput,
    GetWeightsByNameReqOutput,
    WeightsUpdateReqOutput,
    LoRAUpdateOutput,
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
    LoadReport,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_batch_decoder = msgspec.msgpack.Decoder(list[Message])
_stage_result_decoder = msgspec.msgpack.Decoder(StageResult)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


def encode_batch(msgs: list[Message]) -> bytes:
    """The messages one scheduler step received, for the other ranks (empty: no bytes)."""
    return _encoder.encode(msgs) if msgs else b""


def decode_batch(data: bytes) -> list[Message]:
    return _batch_decoder.decode(data) if data else []


def decode_stage_result(data: bytes) -> StageResult:
    return _stage_result_decoder.decode(data)
