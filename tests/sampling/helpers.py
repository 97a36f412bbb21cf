"""Builders shared by the sampling tests."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.sampling import SamplingParams
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

EOS_IDS = (1,)


def make_info(
    params: Sequence[SamplingParams],
    vocab_size: int,
    output_ids: Sequence[Sequence[int]] | None = None,
    input_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Sequence[int] = EOS_IDS,
) -> SamplingBatchInfo:
    """Build a CPU batch; requests default to a one-token prompt and no output yet."""
    return SamplingBatchInfo.from_params(
        list(params),
        output_ids if output_ids is not None else [[] for _ in params],
        input_ids if input_ids is not None else [[0] for _ in params],
        list(eos_token_ids),
        vocab_size,
        "cpu",
    )
