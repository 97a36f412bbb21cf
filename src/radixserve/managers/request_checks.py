"""What a request must satisfy to run, checked in one place with one set of messages.

The TokenizerManager checks every prompt before anything is sent (a bad prompt of a batch fails
the whole call, nothing runs); the scheduler checks again what only it knows whole: a session
request's prompt as assembled from its session, and (its own check, after these) whether the
request fits the KV pool. Both call the functions here, so a client gets the same 400 message
whichever of the two refuses. Each raises ``ValueError``.
"""

from __future__ import annotations

from radixserve.sampling.sampling_params import SamplingParams


def check_token_ids(ids: list[int], vocab_size: int, what: str = "input_ids") -> None:
    """Every id is a token of the vocabulary."""
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        verb = "contain" if what.endswith("s") else "contains"
        raise ValueError(
            f"{what} {verb} token ids outside the vocabulary [0, {vocab_size}): {bad[:10]}"
        )


def check_generate(
    ids: list[int],
    sampling_params: SamplingParams,
    *,
    vocab_size: int,
    context_len: int,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
    token_ids_logprob: list[int] | None = None,
    whole_prompt: bool = True,
) -> None:
    """A generation of ``ids``. ``whole_prompt`` False: ``ids`` is what a session request adds
    to its session's context, whose whole prompt the scheduler checks once assembled; only what
    holds for any part (ids, lengths as lower bounds, sampling values) is checked."""
    if not ids:
        raise ValueError("the prompt is empty")
    check_token_ids(ids, vocab_size)
    sampling_params.validate(vocab_size)
    check_token_ids(token_ids_logprob or [], vocab_size, "token_ids_logprob")
    if top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be non-negative, got {top_logprobs_num}")
    prompt_len, max_new = len(ids), sampling_params.max_new_tokens
    if whole_prompt and return_logprob and logprob_start_len > prompt_len:
        raise ValueError(
            f"logprob_start_len ({logprob_start_len}) is beyond the prompt ({prompt_len} tokens)"
        )
    if prompt_len >= context_len:
        raise ValueError(
            f"the prompt is too long: it has {prompt_len} tokens and the model's context "
            f"length is {context_len} tokens"
        )
    if prompt_len + max_new > context_len:
        raise ValueError(
            f"the prompt has {prompt_len} tokens and max_new_tokens is {max_new}: "
            f"{prompt_len + max_new} tokens exceed the model's context length of "
            f"{context_len} tokens"
        )


def check_embedding(ids: list[int], *, vocab_size: int, context_len: int) -> None:
    """An embedding of ``ids`` (a prefill only: the input may fill the whole context)."""
    if not ids:
        raise ValueError("the input is empty")
    check_token_ids(ids, vocab_size)
    if len(ids) > context_len:
        raise ValueError(
            f"the input is too long: it has {len(ids)} tokens and the model's context "
            f"length is {context_len} tokens"
        )
