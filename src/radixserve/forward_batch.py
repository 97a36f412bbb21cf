"""The scheduler/runner/model seam: one ``ForwardBatch`` per model step, and the
``StageActivations`` a pipeline stage hands to the next.

It sits below every user (the scheduler builds it, the runner, the models and the attention
backends read it), so none of them imports another to reach it.

Data flows ``Req`` (scheduler state, per request) → ``ScheduleBatch`` (the running set, scheduler
side) → ``ForwardBatch`` (plain tensors, built by ``ScheduleBatch.to_forward_batch``) → model →
attention backend. The runner never sees a ``Req``; nothing here holds scheduler objects.

Token layout of an EXTEND batch: the new tokens of all requests are concatenated in batch order
(``input_ids``, ``positions`` and ``out_cache_loc`` all have ``sum(extend_seq_lens)`` rows).
Request ``i`` already has ``extend_prefix_lens[i]`` tokens of KV (in ``req_to_token`` row
``req_pool_indices[i]``) and after the step has ``seq_lens[i] = prefix + extend`` tokens there.
A DECODE batch has exactly one new token per request, so ``extend_*`` are ``None``.

Logits: the model returns one row per request (its last new token: the next token's logits),
then, for an EXTEND batch that asks for input logprobs, the rows of the positions
``input_logprob_counts[i]`` positions from extend offset ``input_logprob_starts[i]`` of each
request in batch order; row k scores the prompt token ``input_logprob_targets[k]`` (the token
after its position).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2

    @property
    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of ReqToTokenPool.req_to_token
    seq_lens: torch.Tensor  # [bs] int64, KV length of each request after this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot written for each new token
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] | None = None  # EXTEND only
    extend_seq_lens_cpu: list[int] | None = None  # EXTEND only
    sampling_info: SamplingBatchInfo | None = None
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None  # per request, when return_logprob
    token_ids_logprobs: list[list[int] | None] | None = None  # per request, when any asks
    # Input logprobs (EXTEND only; see the module docstring).
    input_logprob_starts: list[int] | None = None
    input_logprob_counts: list[int] | None = None
    input_logprob_targets: list[int] | None = None
    # Each request's LoRA adapter slot (-1: the base model); None when no request has one.
    lora_slots: list[int] | None = None
    # Encoders' segment ids, one per token (pairs given to a cross-encoder); None: all 0.
    token_type_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StageActivations:
    """What a pipeline stage hands to the next: the residual stream as ``hidden_states +
    residual`` (the add is left to the next layer's norm, see ``LlamaDecoderLayer.forward``)."""

    hidden_states: torch.Tensor  # [num_tokens, hidden]
    residual: torch.Tensor  # [num_tokens, hidden]
