"""What the speculative decoding tests share (``test_speculative.py``: NGRAM,
``test_speculative_draft.py``: STANDALONE): prompts whose greedy outputs repeat, one run of the
same requests through a plain and a speculative in-process scheduler, the comparison of the two,
session turns run both ways, and the chi-square statistic of the sampling tests.

Every driver comes from ``new_driver``, so the leak check of ``conftest.py`` covers it (and,
for STANDALONE, the draft model's pool and rows).
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.managers.io_struct import (
    CloseSessionReqInput,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from tests.checkpoints import VOCAB_SIZE
from tests.managers.conftest import Result, make_prompts, new_driver

MAX_NEW = 40
# chi-square critical value for 5 degrees of freedom at p = 0.001
CHI2_5_DOF_999 = 20.52


def repetitive_prompts() -> list[list[int]]:
    """Random prompts, and prompts made of a repeated phrase (drafts from the prompt)."""
    prompts = make_prompts(VOCAB_SIZE, (3, 17, 40, 71), seed=5)
    for n, phrase_len in ((60, 7), (45, 11), (90, 5)):
        phrase = make_prompts(VOCAB_SIZE, (phrase_len,), seed=n)[0]
        prompts.append((phrase * (n // phrase_len + 1))[:n])
    return prompts


def run_both(path, flags: dict[str, Any], prompts: list[list[int]],
             per_request: dict[str, dict[str, Any]] | None = None, *,
             params: dict[str, Any] | None = None, **overrides: Any):
    """The same requests (``p0``, ``p1``, ...) through a plain scheduler and one with
    ``flags``: ``(plain results, speculative results, the speculative scheduler)``.
    ``params`` apply to every request, ``per_request[rid]`` to one; ``overrides`` are server
    arguments of both schedulers."""
    results = []
    for spec in (False, True):
        driver = new_driver(path, **(flags if spec else {}), **overrides)
        for i, ids in enumerate(prompts):
            request = {"max_new_tokens": MAX_NEW, **(params or {}),
                       **(per_request or {}).get(f"p{i}", {})}
            driver.submit(f"p{i}", ids, **request)
        driver.run()
        results.append(driver.results())
    return results[0], results[1], driver.scheduler


def assert_same(plain: dict[str, Result], spec: dict[str, Result]) -> None:
    assert plain.keys() == spec.keys()
    for rid, want in plain.items():
        got = spec[rid]
        assert got.tokens == want.tokens, rid
        assert got.finished_reason == want.finished_reason, rid
        assert got.completion_tokens == len(got.tokens)


def session_turns(path, flags: dict[str, Any], *, streaming: bool,
                  max_new_tokens: int = 16, **overrides: Any):
    """Three turns of one session, each beside a plain request, then a fork of the first turn
    (a non-streaming session only: a streaming one is a single line). ``flags`` empty: the
    plain scheduler. After the session is closed, ``replay`` is a plain request on the last
    turn's whole input (the session's history), served from what the turns left in the radix
    cache. Returns ``({rid: tokens}, the scheduler)``; the plain run (no ``flags``) runs once
    per arguments, shared by the NGRAM and STANDALONE tests (its scheduler: None).

    A streaming session keeps its KV in the session's slot between turns (with the rejected
    drafts' KV freed inside each); a non-streaming turn continues its parent's ids through the
    radix cache. The session is closed at the end, so the leak check sees it all given back."""
    key = (str(path), streaming, max_new_tokens, tuple(sorted(overrides.items())))
    if not flags and key in _plain_sessions:
        return dict(_plain_sessions[key]), None
    prompts = repetitive_prompts()
    turns = [prompts[6][:30], prompts[6][30:45], prompts[4][:20]]
    driver = new_driver(path, enable_streaming_session=streaming, **flags, **overrides)
    driver.send(OpenSessionReqInput(capacity_of_str_len=10_000, session_id="chat",
                                    streaming=streaming))
    assert driver.replies.pop().success
    tokens: dict[str, list[int]] = {}
    history: list[int] = []

    def turn(rid: str, ids: list[int], parent: str | None) -> None:
        driver.send(TokenizedGenerateReqInput(
            rid=rid, input_ids=ids,
            sampling_params=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
            session_params=SessionParams(id="chat", rid=None if streaming else parent),
            stream=True,
        ))

    for i, ids in enumerate(turns):
        driver.submit(f"plain{i}", prompts[2], max_new_tokens=12)
        turn(f"turn{i}", ids, f"turn{i - 1}" if i else None)
        driver.run()
        tokens.update({rid: r.tokens for rid, r in driver.results().items()})
        history += ids + tokens[f"turn{i}"]
    if not streaming:  # a second child of the first turn, beside the line above
        turn("fork", prompts[5][:12], "turn0")
        driver.run()
        tokens.update({rid: r.tokens for rid, r in driver.results().items()})
    driver.send(CloseSessionReqInput(session_id="chat"))
    driver.run()
    last = history[: len(history) - len(tokens["turn2"])]
    driver.submit("replay", last, max_new_tokens=max_new_tokens)
    driver.run()
    replay = driver.results()["replay"]
    if not streaming:  # (a closed streaming session's KV is not left in the radix cache)
        assert replay.cached_tokens > len(turns[0]), replay.cached_tokens
    tokens["replay"] = replay.tokens
    if not flags:
        _plain_sessions[key] = dict(tokens)
    return tokens, driver.scheduler


_plain_sessions: dict[tuple, dict[str, list[int]]] = {}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
