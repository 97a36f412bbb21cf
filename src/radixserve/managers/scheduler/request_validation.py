"""The scheduler's admission checks of a new request: why it cannot run here, or None.

The TokenizerManager's checks again (``managers/request_checks.py``: one function and one
message wherever a request is refused), on what only the scheduler knows whole (a session
request's prompt as assembled from its session), then this scheduler's own sizes: the KV pool
and, for an encoder, the prefill budget. A refused request never reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.managers.request_checks import check_embedding, check_generate
from radixserve.managers.scheduler.schedule_batch import pages_to_alloc


@dataclass(frozen=True)
class RequestLimits:
    """The sizes a request is checked against (fixed for the scheduler's life)."""

    vocab_size: int
    context_len: int
    page_size: int
    max_total_num_tokens: int  # the KV pool
    is_encoder: bool  # its input is encoded in one step


def generate_error(
    ids: list[int], msg: TokenizedGenerateReqInput, limits: RequestLimits
) -> str | None:
    """Why generate request ``msg`` with the whole prompt ``ids`` cannot run, or None."""
    try:
        check_generate(
            ids, msg.sampling_params,
            vocab_size=limits.vocab_size,
            context_len=limits.context_len,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, token_ids_logprob=msg.token_ids_logprob,
        )
    except ValueError as e:
        return str(e)
    if pages_to_alloc(0, len(ids) + 1, limits.page_size) > limits.max_total_num_tokens:
        return (
            f"the prompt ({len(ids)} tokens) does not fit in the KV cache "
            f"({limits.max_total_num_tokens} tokens)"
        )
    return None


def embedding_error(ids: list[int], limits: RequestLimits, prefill_budget: int) -> str | None:
    """Why an embedding of ``ids`` cannot run, or None. ``prefill_budget``: the tokens one
    prefill batch may take now (``set_internal_state`` changes it)."""
    try:
        check_embedding(ids, vocab_size=limits.vocab_size, context_len=limits.context_len)
    except ValueError as e:
        return str(e)
    # An encoder's input is encoded in one step: it must fit one prefill batch.
    if limits.is_encoder and len(ids) > prefill_budget:
        return (
            f"the input ({len(ids)} tokens) exceeds the prefill budget ({prefill_budget} tokens)"
        )
    if pages_to_alloc(0, len(ids), limits.page_size) > limits.max_total_num_tokens:
        return (
            f"the input ({len(ids)} tokens) does not fit in the KV cache "
            f"({limits.max_total_num_tokens} tokens)"
        )
    return None
