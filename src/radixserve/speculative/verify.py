"""Verification of draft tokens against the target model, and the KV of rejected drafts.

One verify step runs the target over ``[last token, d_1, ..., d_k]`` of each request (an EXTEND
with per-request draft lengths ``k``, possibly 0): row ``j`` of its logits predicts the token
after ``d_j`` (row 0: after the last accepted token). ``targets[j]`` is the target's own choice
there.

**Greedy acceptance** (exact): draft ``d_{j+1}`` is accepted while it equals ``targets[j]``; the
request then gains the accepted drafts plus one more token, the target's choice after the last
accepted one (the "bonus"): ``targets[: a + 1]``. Every token so gained is the target's argmax
given the tokens before it, so the output is the target's greedy output, token for token, only
computed up to ``k + 1`` tokens per forward.

**Rejection sampling** (exact for sampled requests): the NGRAM draft is deterministic, a point
mass on ``d``. Draft ``d`` at position ``j`` is kept with probability ``p_j(d)``, where ``p_j``
is the target's distribution there after temperature, top-k, top-p and min-p (what the sampler
would draw from); at the first rejection the token is drawn from ``p_j`` with ``d`` removed and
renormalised, and nothing after it is kept; when every draft is kept, one more token is drawn
from ``p_k``. Each emitted token then has exactly the target's distribution:
``P(d) = p(d)`` and ``P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x)`` for ``x != d``.

**Drafts drawn from a distribution** ``q`` (a draft model's sampled request): draft ``d`` is
kept with probability ``min(1, p(d) / q(d))``, and at a rejection the token is drawn from
``(p - q)+`` renormalised: the standard speculative sampling rule (Leviathan et al., Chen et
al.), whose emitted tokens again have exactly the distribution ``p``; a point mass ``q`` gives
the rule above.

**KV of rejected drafts.** The verify forward wrote KV for all ``k`` drafts. After it a request
keeps KV for positions ``< kv_len`` (its newest token's KV comes with the next step, as after a
decode step); ``free_rejected_kv`` returns the pages of its row that lie wholly at or beyond
``kv_len``. A partly used page stays with the request: the allocator continues it at
``last_loc + 1`` (``mem_cache/allocator.py``), so stale K/V there is overwritten before it is
ever attended to (attention reads only positions ``< seq_len``).
"""

from __future__ import annotations

import torch


def greedy_accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a request gains: its longest draft prefix that equals the target's choices,
    plus the target's next token. ``len(targets) == len(drafts) + 1``."""
    assert len(targets) == len(drafts) + 1, (len(drafts), len(targets))
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return targets[: accepted + 1]


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The distribution the sampler draws from for one request, at each row of ``logits``
    (``[rows, vocab]``): softmax at ``temperature``, then top-k/top-p, then min-p (the
    sampler's own filters, ``layers/sampler.py``), unnormalised after filtering."""
    from radixserve.layers.sampler import _filter_min_p, _filter_top_k_top_p

    rows, vocab = logits.shape
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k not in (-1, vocab) or top_p < 1.0:
        k = vocab if top_k == -1 else min(top_k, vocab)
        probs = _filter_top_k_top_p(
            probs,
            torch.full((rows,), k, dtype=torch.int64, device=probs.device),
            torch.full((rows,), top_p, dtype=torch.float32, device=probs.device),
        )
    if min_p > 0.0:
        probs = _filter_min_p(probs, torch.full((rows,), min_p, device=probs.device))
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_accept(
    drafts: list[int], probs: torch.Tensor, generator: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens a sampled request gains (module doc): ``probs`` ``[len(drafts) + 1, vocab]``
    are the target's (possibly unnormalised) distributions after ``[newest token, drafts]``;
    ``draft_probs`` ``[len(drafts), vocab]`` the distributions the drafts were drawn from (None:
    deterministic drafts, a point mass on each)."""
    assert probs.shape[0] == len(drafts) + 1, (len(drafts), probs.shape)
    probs = probs.float().cpu()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if draft_probs is not None:
        assert draft_probs.shape[0] == len(drafts), (len(drafts), draft_probs.shape)
        draft_probs = draft_probs.float().cpu()
    uniforms = torch.rand(len(drafts), generator=generator).tolist()
    out: list[int] = []
    for j, draft in enumerate(drafts):
        q = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if uniforms[j] * q < float(probs[j, draft]):  # u < min(1, p(d) / q(d))
            out.append(draft)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[draft] = 0.0
        else:  # (p - q)+: positive wherever a rejection could happen (p(d) < q(d))
            residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def free_rejected_kv(
    allocator, req_to_token: torch.Tensor, row: int, kv_len: int, allocated_end: int
) -> None:
    """Free the KV slots of positions ``[kv_len, allocated_end)`` of ``row`` that sit in pages
    of their own (whole pages from the first page boundary at or after ``kv_len``); the
    request's partial last page stays with it."""
    page = allocator.page_size
    first = -(-kv_len // page) * page
    if first >= allocated_end:
        return
    slots = req_to_token[row, first:allocated_end]
    allocator.free(slots.to(allocator.device))
