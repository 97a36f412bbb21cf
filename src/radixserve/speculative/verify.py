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
