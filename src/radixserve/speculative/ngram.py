"""NGRAM proposer (prompt lookup): draft tokens copied from the request's own prompt and output.

When the last ``w`` tokens of a request (its suffix) occurred earlier in its prompt + output,
the tokens that followed that earlier occurrence are a good guess for what comes next: an "edit
this code" answer repeats long runs of its prompt, a summary quotes it. The proposer looks for
the longest such suffix, from ``max_window`` tokens down to ``min_window``
(``--speculative-ngram-max/min-match-window-size``, SGLang's names), at its most recent
occurrence, and proposes up to ``max_len`` of the tokens after it. No match: no drafts, and the
request decodes one token as without speculation.

The search is vectorised with numpy over the positions holding the request's last token, so a
proposal costs microseconds for prompts of thousands of tokens (the cost of a failed proposal
must stay small: docs/speculative.md).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(
                f"need 1 <= min_window <= max_window, got {min_window}, {max_window}"
            )
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, tokens: list[int], max_len: int) -> list[int]:
        """Up to ``max_len`` draft tokens to follow ``tokens`` (possibly none)."""
        n = len(tokens)
        if max_len <= 0 or n < self.min_window + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # Candidate ends j of an earlier occurrence: arr[j] == the last token, j < n - 1.
        ends = np.flatnonzero(arr[: n - 1] == arr[n - 1])
        if ends.size == 0:
            return []
        match = np.ones(ends.size, dtype=np.int64)  # matched suffix length at each end
        alive = np.ones(ends.size, dtype=bool)
        for k in range(1, min(self.max_window, n - 1)):
            pos = ends - k
            ok = alive & (pos >= 0)
            ok[ok] = arr[pos[ok]] == arr[n - 1 - k]
            if not ok.any():
                break
            match[ok] += 1
            alive = ok
        best = int(match.max())
        if best < self.min_window:
            return []
        j = int(ends[np.flatnonzero(match == best)[-1]])  # the most recent longest match
        return arr[j + 1 : j + 1 + max_len].tolist()
