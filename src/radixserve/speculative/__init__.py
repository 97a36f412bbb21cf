"""Speculative decoding: proposers of draft tokens and the exact verification rules
(docs/speculative.md).

This package holds what does not know the scheduler: ``ngram.py`` (prompt lookup over a
request's own tokens), ``verify.py`` (greedy acceptance, rejection sampling, and freeing the KV
of rejected drafts).
The scheduler's side (drafting a decode batch, the target's verify forward, applying accepted
tokens to requests) is ``managers/scheduler/speculative_decoder.py``.
"""

from radixserve.speculative.ngram import NgramProposer
from radixserve.speculative.verify import (
    free_rejected_kv,
    greedy_accept,
    rejection_accept,
    sampling_probs,
)

__all__ = [
    "NgramProposer", "free_rejected_kv", "greedy_accept", "rejection_accept", "sampling_probs",
]
