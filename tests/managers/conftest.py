"""Drive a real in-process ``Scheduler`` on tiny checkpoints; compare with transformers.

``SchedulerDriver`` feeds ``TokenizedGenerateReqInput`` messages, steps until idle and folds the
``BatchTokenIDOutput`` messages into one ``Result`` per request. Every driver a test touches is
leak-checked after the test (``RADIXSERVE_TEST_STRICT=1`` makes a leak raise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.managers.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from radixserve.managers.scheduler.scheduler_builder import build_scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

# Mixed prompt lengths (token ids 6.. skip the special tokens of the test tokenizer).
PROMPT_LENS = (3, 9, 17, 26, 40, 55, 71, 90)
MAX_NEW_TOKENS = 20
# Below this top-2 logit margin, transformers' own choice is a numerical coin toss.
MARGIN_TOLERANCE = 1e-3
LOGPROB_TOLERANCE = 1e-4


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab_size, (n,), generator=gen).tolist() for n in lens]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list | None = None
    finished_reason: dict[str, Any] | None = None  # as the edges show it (SGLang's dict)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_outputs: int = 0


class SchedulerDriver:
    """A ``Scheduler`` whose outputs land in lists (no processes, no sockets)."""

    def __init__(self, model_path: Path, **overrides: Any) -> None:
        args = {"model_path": str(model_path), "device": "cpu", "max_total_tokens": 4096}
        args.update(overrides)
        self.outputs: list[BatchTokenIDOutput] = []
        self.replies: list[Any] = []
        self.scheduler = build_scheduler(
            ServerArgs(**args), self.outputs.append, self.replies.append
        )
        self._consumed = 0

    def submit(self, rid: str, input_ids: list[int], *, stream: bool = False,
               return_logprob: bool = False, top_logprobs_num: int = 0,
               logprob_start_len: int = -1, **params: Any) -> None:
        params.setdefault("temperature", 0.0)
        params.setdefault("max_new_tokens", MAX_NEW_TOKENS)
        self.send(TokenizedGenerateReqInput(
            rid=rid, input_ids=input_ids, sampling_params=SamplingParams(**params),
            stream=stream, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
        ))

    def send(self, msg: Any) -> None:
        self.scheduler.process_input_requests([msg])

    def run(self, max_steps: int = 5000) -> int:
        """Step until idle; returns the number of model steps."""
        for n in range(max_steps):
            if not self.scheduler.step():
                return n
        raise AssertionError("scheduler did not go idle")

    def results(self) -> dict[str, Result]:
        """Fold the outputs received since the last call into one ``Result`` per request."""
        out: dict[str, Result] = {}
        for batch in self.outputs[self._consumed:]:
            for o in batch.outputs:
                r = out.setdefault(o.rid, Result())
                r.tokens += o.new_token_ids
                if o.logprobs is not None:
                    r.logprobs += o.logprobs.output
                    r.top_logprobs += o.logprobs.output_top or []
                    if o.logprobs.input is not None:
                        r.input_logprobs = o.logprobs.input
                        r.input_top_logprobs = o.logprobs.input_top
                reason = o.finished_reason
                r.finished_reason = reason.to_dict() if reason is not None else None
                r.cached_tokens = o.cached_tokens
                r.prompt_tokens = o.prompt_tokens
                r.completion_tokens = o.completion_tokens
                r.num_outputs += 1
        self._consumed = len(self.outputs)
        return out

    def generate(self, prompts: dict[str, list[int]], **kwargs: Any) -> dict[str, Result]:
        for rid, ids in prompts.items():
            self.submit(rid, ids, **kwargs)
        self.run()
        return self.results()


_live_drivers: list[SchedulerDriver] = []


@pytest.fixture
def driver_factory():
    """Module fixtures call ``new_driver``; drivers are leak-checked after every test."""
    return new_driver


def new_driver(model_path: Path, **overrides: Any) -> SchedulerDriver:
    driver = SchedulerDriver(model_path, **overrides)
    _live_drivers.append(driver)
    return driver


@pytest.fixture(autouse=True)
def check_no_leak(monkeypatch):
    """After each test every scheduler must be idle with the memory invariant intact."""
    monkeypatch.setenv("RADIXSERVE_TEST_STRICT", "1")
    yield
    for driver in _live_drivers:
        sched = driver.scheduler
        driver.run()
        sched.self_check_during_idle()  # raises on a leak (strict)
        assert sched.last_leak_check["ok"], sched.last_leak_check
        draft = getattr(getattr(sched.loop, "decoder", None), "draft_model", None)
        if draft is not None:  # STANDALONE: the draft model's pool and rows are all free
            assert draft.is_empty(), (len(draft.states), draft.runner.max_total_num_tokens,
                                      draft.runner.token_to_kv_pool_allocator.available_size())


@dataclass
class Reference:
    """transformers greedy output for one prompt, with per-step diagnostics."""

    tokens: list[int]
    logprobs: list[float]  # log_softmax of the raw logits at the chosen token
    margins: list[float]  # top-1 minus top-2 logit


_reference_cache: dict[tuple[str, int], list[Reference]] = {}


def hf_reference(model_path: Path, prompts: list[list[int]],
                 max_new_tokens: int = MAX_NEW_TOKENS) -> list[Reference]:
    """Greedy ``generate`` of transformers, one prompt at a time (no padding), cached."""
    key = (str(model_path), hash((tuple(map(tuple, prompts)), max_new_tokens)))
    if key in _reference_cache:
        return _reference_cache[key]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            out = model.generate(
                inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids):].tolist()
            logits = torch.cat(out.logits)[: len(tokens)].float()
            logprobs = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
            top2 = logits.topk(2, dim=-1).values
            refs.append(Reference(tokens, logprobs.tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    _reference_cache[key] = refs
    return refs


def assert_matches_reference(result: Result, ref: Reference, check_logprobs: bool = False) -> None:
    """Token-for-token equality; a divergence only where transformers' margin is below 1e-3."""
    for step, (ours, theirs) in enumerate(zip(result.tokens, ref.tokens, strict=False)):
        if check_logprobs:
            assert abs(result.logprobs[step] - ref.logprobs[step]) < LOGPROB_TOLERANCE, (
                f"logprob at step {step}: {result.logprobs[step]} vs {ref.logprobs[step]}"
            )
        if ours != theirs:
            assert ref.margins[step] < MARGIN_TOLERANCE, (
                f"diverged at step {step} ({ours} vs {theirs}) where transformers' top-2 margin "
                f"is {ref.margins[step]:.2e}: {result.tokens} vs {ref.tokens}"
            )
            return
    assert result.tokens == ref.tokens
