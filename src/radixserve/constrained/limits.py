"""Bounds on what one constrained request's grammar may cost the others: its compile, its steps.

Compile: grammars compile one at a time on a worker thread (``GrammarCache``), so a compile
that never ends would hold every later grammar behind it. A request whose grammar has not
compiled within ``RADIXSERVE_GRAMMAR_TIMEOUT`` seconds (default 300, as SGLang's
``SGLANG_GRAMMAR_TIMEOUT``) ends with a 400 (``GrammarQueue``); the compile itself runs on.

Steps: a matcher's work per token is usually microseconds, but an ambiguous grammar (a bounded
repetition of a part that can be empty, written as a regex or in EBNF) keeps every way of
splitting the text alive, and each token then costs more than the one before: measured with
xgrammar 0.2.x, ``root ::= (([a-z]{0,30}){0,29}){0,31}`` took 1.7 s for one token within 30.
Matching runs on the scheduler's thread, so every other request waits for it. Regexes of that
shape are refused before compiling (``regex_support.py``); the step budget catches what a static
check cannot see: ``TimedMatcher`` remembers a request's slowest step (mask or advance), and the
scheduler ends the request with a 400 once a step took ``RADIXSERVE_GRAMMAR_STEP_BUDGET``
seconds or more (default 0.5, a hundred times what a usual step takes; 0 ends every constrained
request after its first token, which is how tests see it act). Steps are timed in the scheduler
thread's CPU time, so a thread descheduled by a busy machine never looks like a slow grammar.

With tensor or pipeline parallelism both are off (and setting them is refused): each rank reads
its own clocks, and ranks that ended different requests would run different batches.
"""

from __future__ import annotations

import math
import time

import torch

from radixserve import envs
from radixserve.constrained.base import GrammarMatcher

DEFAULT_STEP_BUDGET_S = 0.5
DEFAULT_COMPILE_TIMEOUT_S = 300.0


def step_budget_s(distributed: bool) -> float:
    """``RADIXSERVE_GRAMMAR_STEP_BUDGET`` in seconds (a number >= 0); infinite for the ranks of
    a ``distributed`` model (see the module docstring)."""
    return _seconds(envs.RADIXSERVE_GRAMMAR_STEP_BUDGET, DEFAULT_STEP_BUDGET_S, distributed)


def compile_timeout_s(distributed: bool) -> float:
    """``RADIXSERVE_GRAMMAR_TIMEOUT`` in seconds (a number >= 0); infinite for the ranks of a
    ``distributed`` model, which wait for every compile together (each reads its own clock)."""
    return _seconds(envs.RADIXSERVE_GRAMMAR_TIMEOUT, DEFAULT_COMPILE_TIMEOUT_S, distributed)


def _seconds(env: envs.EnvStr, default: float, distributed: bool) -> float:
    value = env.get("")
    if distributed:
        if value:
            raise ValueError(f"{env.name} does not combine with tensor or pipeline parallelism")
        return math.inf
    value = value or str(default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0.0:  # NaN too
        raise ValueError(f"{env.name} must be seconds >= 0, got {value!r}")
    return seconds


class TimedMatcher(GrammarMatcher):
    """``inner`` with the CPU time of its slowest step so far (``slowest_s``)."""

    def __init__(self, inner: GrammarMatcher) -> None:
        self.inner = inner
        self.slowest_s = 0.0

    def _took(self, start: float) -> None:
        self.slowest_s = max(self.slowest_s, time.thread_time() - start)

    def accept_token(self, token_id: int) -> bool:
        start = time.thread_time()
        try:
            return self.inner.accept_token(token_id)
        finally:
            self._took(start)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        start = time.thread_time()
        try:
            self.inner.fill_bitmask(bitmask, row)
        finally:
            self._took(start)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


def over_budget_message(slowest_s: float, budget_s: float) -> str:
    return (f"constrained decoding stopped: one step of this request's grammar took "
            f"{slowest_s:.3f} s, over the {budget_s:g} s budget (RADIXSERVE_GRAMMAR_STEP_BUDGET); "
            "its matching cost grows with the output, as for an ambiguous grammar such as a "
            "bounded repetition of a part that can match the empty string")


def compile_timeout_message(timeout_s: float) -> str:
    return (f"the grammar did not compile within {timeout_s:g} s (RADIXSERVE_GRAMMAR_TIMEOUT): "
            "it is too complex, or the grammars compiling before it were")
