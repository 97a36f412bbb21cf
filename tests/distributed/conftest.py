"""Fixtures and helpers of the parallelism tests (tensor, pipeline, data parallel, router).

Multi-rank servers are slow to start on two cores: each module starts as few as it can and
shares them between its tests. Greedy outputs are compared with transformers and with the
one-process scheduler (``SchedulerDriver``) on the same settings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.managers.conftest import (
    MARGIN_TOLERANCE,
    MAX_NEW_TOKENS,
    Reference,
    Result,
    SchedulerDriver,
    assert_matches_reference,
    hf_reference,
    make_prompts,
)
from tests.server.conftest import client  # noqa: F401 - the API suites' fixture, on our servers

# One configuration that exercises every memory mechanism at once: prompts longer than a prefill
# chunk, a KV pool far smaller than the batch needs with admission reserving almost nothing (so
# decoding must retract), and at most 16 running requests.
SCENARIO_ARGS: dict[str, Any] = {
    "max_total_tokens": 192,
    "schedule_conservativeness": 0.01,
    "chunked_prefill_size": 16,
    "max_running_requests": 16,
}
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}


@pytest.fixture(scope="module")
def strict_env() -> Iterator[None]:
    """Spawned children inherit the environment at start: a leak makes them raise."""
    old = os.environ.get("RADIXSERVE_TEST_STRICT")
    os.environ["RADIXSERVE_TEST_STRICT"] = "1"
    yield
    if old is None:
        del os.environ["RADIXSERVE_TEST_STRICT"]
    else:
        os.environ["RADIXSERVE_TEST_STRICT"] = old


def as_result(out: dict[str, Any]) -> Result:
    """An ``Engine``/``/generate`` output as the scheduler tests' ``Result``."""
    meta = out["meta_info"]
    return Result(
        tokens=list(out["output_ids"]),
        logprobs=[entry[0] for entry in meta.get("output_token_logprobs", [])],
        finished_reason=meta["finish_reason"],
        cached_tokens=meta["cached_tokens"],
        prompt_tokens=meta["prompt_tokens"],
        completion_tokens=meta["completion_tokens"],
    )


def assert_same_greedy(ours: list[int], theirs: list[int], ref: Reference) -> None:
    """Two greedy runs of one prompt agree token for token; they may part only where even
    transformers' choice is a coin toss (its top-2 margin below ``MARGIN_TOLERANCE``)."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            assert step < len(ref.margins) and ref.margins[step] < MARGIN_TOLERANCE, (
                f"diverged at step {step} ({a} vs {b}) with transformers' top-2 margin "
                f"{ref.margins[step]:.2e}: {ours} vs {theirs}"
            )
            return
    assert ours == theirs


def run_scenario(engine: Any, path: Path, vocab_size: int) -> dict[str, Any]:
    """The scenario batch (mixed prompt lengths, greedy, logprobs), then one prompt twice (the
    second is a radix-cache hit); the outputs and the scheduler's state."""
    prompts = make_prompts(vocab_size)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    repeat = make_prompts(vocab_size, (37,), seed=1)[0]
    first = engine.generate(input_ids=repeat, sampling_params=GREEDY)
    second = engine.generate(input_ids=repeat, sampling_params=GREEDY)
    return {
        "prompts": prompts,
        "results": [as_result(o) for o in outs],
        "repeat": (as_result(first), as_result(second)),
        "state": engine.get_server_info()["internal_states"][0],
        "refs": hf_reference(path, prompts),
    }


def one_process_results(path: Path, prompts: list[list[int]]) -> list[Result]:
    """The same batch on the one-process scheduler with the scenario's settings."""
    driver = SchedulerDriver(path, **SCENARIO_ARGS)
    results = driver.generate({f"p{i}": ids for i, ids in enumerate(prompts)},
                              return_logprob=True)
    return [results[f"p{i}"] for i in range(len(prompts))]


def check_scenario(run: dict[str, Any], path: Path) -> None:
    """Everything ``run_scenario`` must show on any topology."""
    for result, ref in zip(run["results"], run["refs"], strict=True):
        assert_matches_reference(result, ref, check_logprobs=True)
        assert result.finished_reason["type"] in ("length", "stop")
    single = one_process_results(path, run["prompts"])
    for ours, theirs, ref in zip(run["results"], single, run["refs"], strict=True):
        assert_same_greedy(ours.tokens, theirs.tokens, ref)
    state = run["state"]
    assert state["num_retracted_reqs"] > 0, "the small KV pool must have forced retraction"
    assert state["last_leak_check"]["ok"], state["last_leak_check"]
    first, second = run["repeat"]
    assert first.cached_tokens == 0 and second.cached_tokens == 36
    assert second.tokens == first.tokens
