"""Requests waiting for their grammar to compile, before they may be scheduled.

A constrained request (``json_schema``, ``regex``, ``ebnf`` or ``structural_tag``) enters this
queue instead of the waiting queue; its grammar compiles on the ``GrammarCache``'s worker thread
(at once if it is cached), so a slow compilation never stalls the batches that run meanwhile.
Each scheduler step moves the requests whose grammar is ready to the waiting queue, in arrival
order, each with a fresh matcher; a grammar that fails to compile fails its request with a 400
carrying the grammar library's message, before anything of it was scheduled, and so does one that
has not compiled within the timeout (``constrained/limits.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

from radixserve.constrained import GrammarCache, GrammarError, GrammarKey
from radixserve.constrained.limits import TimedMatcher, compile_timeout_message
from radixserve.finish_reason import FinishAbort
from radixserve.managers.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass
class Compiled:
    """What ``GrammarQueue.pop_compiled`` found: requests ready to schedule and failures."""

    ready: list[Req] = field(default_factory=list)
    failed: list[tuple[Req, FinishAbort]] = field(default_factory=list)


class GrammarQueue:
    """``timeout_s``: how long a request may wait for its compile (``constrained/limits.py``)."""

    def __init__(self, cache: GrammarCache, timeout_s: float = math.inf) -> None:
        self.cache = cache
        self.timeout_s = timeout_s
        self.reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, req: Req) -> None:
        """Start (or join) the compilation of ``req``'s grammar and queue it."""
        grammar = req.sampling_params.grammar
        assert grammar is not None, "only constrained requests wait for a grammar"
        req.grammar_future = self.cache.get(GrammarKey(*grammar))
        self.reqs.append(req)

    def pop_compiled(self, wait_all: bool = False) -> Compiled:
        """Take every request whose compilation finished, in arrival order. ``wait_all``: wait
        for every queued compilation first (parallel ranks compile on their own, and must admit
        the same requests at the same step)."""
        if wait_all:
            wait([r.grammar_future for r in self.reqs])
        out = Compiled()
        waiting = []
        now = time.monotonic()
        for req in self.reqs:
            future = req.grammar_future
            if not future.done():
                if now - req.queued_at < self.timeout_s:  # queued when it arrived
                    waiting.append(req)
                    continue
                # The compile goes on (a thread cannot be stopped); the request stops waiting.
                out.failed.append((req, FinishAbort(
                    message=compile_timeout_message(self.timeout_s), status_code=400)))
                req.grammar_future = None
                continue
            req.grammar_future = None
            try:
                req.grammar = TimedMatcher(self.cache.backend.new_matcher(future.result()))
            except GrammarError as e:
                out.failed.append((req, FinishAbort(message=str(e), status_code=400)))
            except Exception as e:  # the backend itself failed: a server problem, not the user's
                logger.exception("grammar compilation failed for request %r", req.rid)
                message = f"constrained decoding failed: {type(e).__name__}: {e}"
                out.failed.append((req, FinishAbort(message=message)))
            else:
                out.ready.append(req)
        self.reqs = waiting
        return out

    def remove(self, hit: Callable[[Req], bool]) -> list[Req]:
        """Take the requests ``hit`` selects out of the queue (aborts)."""
        removed = [r for r in self.reqs if hit(r)]
        self.reqs = [r for r in self.reqs if not hit(r)]
        for req in removed:
            req.grammar_future = None
        return removed

    def wait(self, timeout: float) -> None:
        """Block until a compilation finishes, or ``timeout`` seconds."""
        wait([r.grammar_future for r in self.reqs], timeout=timeout, return_when=FIRST_COMPLETED)
