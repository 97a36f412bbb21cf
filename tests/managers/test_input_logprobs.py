"""Input (prompt) logprobs equal transformers' log-softmax, however the prompt was computed.

Position p's logprob is ``log_softmax(logits[p - 1])[ids[p]]`` from one transformers forward
over the whole prompt; position 0 has none. Chunked prefill computes them chunk by chunk; a
radix-cache hit reuses no position they need (those are recomputed: the cache keeps KV, not
logits).
"""

from __future__ import annotations

import pytest
import torch

from tests.managers.conftest import LOGPROB_TOLERANCE, make_prompts, new_driver

PROMPT_LENS = (1, 2, 9, 37, 70)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(512, PROMPT_LENS, seed=11)


@pytest.fixture(scope="module")
def reference(llama_path, prompts):
    """Per prompt: ``[len, vocab]`` log-softmax of transformers' logits at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                for ids in prompts]


def expected(ref: torch.Tensor, ids: list[int], start: int) -> list[float | None]:
    return [None if p == 0 else float(ref[p - 1, ids[p]]) for p in range(start, len(ids))]


def assert_close(ours: list[float | None], theirs: list[float | None]) -> None:
    assert len(ours) == len(theirs)
    for p, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert (a is None) == (b is None), p
        if a is not None:
            assert abs(a - b) < LOGPROB_TOLERANCE, (p, a, b)


CONFIGS = {
    "default": {},
    "chunked": {"chunked_prefill_size": 8},
    "page16_chunked": {"page_size": 16, "chunked_prefill_size": 16},
    "overlap": {"enable_overlap_schedule": True},
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("max_new_tokens", [0, 3])
def test_input_logprobs_equal_transformers(llama_path, prompts, reference, config,
                                           max_new_tokens):
    driver = new_driver(llama_path, **CONFIGS[config])
    starts = {}
    for i, ids in enumerate(prompts):
        for start in sorted({0, 1, len(ids) // 2, len(ids) - 1, len(ids)}):
            rid = f"p{i}s{start}"
            starts[rid] = (i, start)
            driver.submit(rid, ids, return_logprob=True, logprob_start_len=start,
                          max_new_tokens=max_new_tokens)
    driver.run()
    results = driver.results()
    for rid, (i, start) in starts.items():
        result = results[rid]
        assert len(result.tokens) == max_new_tokens == len(result.logprobs)
        assert_close(result.input_logprobs, expected(reference[i], prompts[i], start))


def test_radix_cache_hit_recomputes_the_positions_input_logprobs_need(llama_path, prompts,
                                                                      reference):
    driver = new_driver(llama_path)
    ids = prompts[4]
    driver.generate({"warm": ids}, max_new_tokens=1)
    driver.submit("hit", ids, return_logprob=True, logprob_start_len=30, max_new_tokens=1)
    driver.submit("no_logprobs", ids, max_new_tokens=1)
    driver.run()
    results = driver.results()
    # The whole prompt but its last token is cached; the logprob request reuses only what comes
    # before position 29 (whose logits score token 30).
    assert results["no_logprobs"].cached_tokens == len(ids) - 1
    assert results["hit"].cached_tokens == 29
    assert_close(results["hit"].input_logprobs, expected(reference[4], ids, 30))


def test_input_top_logprobs_and_token_ids_logprobs(llama_path, prompts, reference):
    from radixserve.managers.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling.sampling_params import SamplingParams

    driver = new_driver(llama_path)
    ids, ref = prompts[3], reference[3]
    asked = [7, 100, 333]
    driver.send(TokenizedGenerateReqInput(
        rid="r", input_ids=ids, sampling_params=SamplingParams(temperature=0, max_new_tokens=2),
        return_logprob=True, logprob_start_len=0, top_logprobs_num=4, token_ids_logprob=asked))
    driver.run()
    (report,) = [o for b in driver.outputs for o in b.outputs if o.rid == "r"]
    logprobs = report.logprobs
    assert logprobs.input_token_ids == ids
    assert logprobs.input_top[0] is None and logprobs.input_token_ids_logprobs[0] is None
    for p in range(1, len(ids)):
        values, top_ids = ref[p - 1].topk(4)
        assert [t for t, _ in logprobs.input_top[p]] == top_ids.tolist()
        assert logprobs.input_top[p][0][1] == pytest.approx(float(values[0]), abs=1e-4)
        by_id = logprobs.input_token_ids_logprobs[p]
        assert by_id == pytest.approx([float(ref[p - 1, t]) for t in asked], abs=1e-4)
    # Output positions: the asked ids' logprobs, consistent with the chosen token's.
    assert len(logprobs.output_token_ids) == 2
    chosen = report.new_token_ids[0]
    driver.send(TokenizedGenerateReqInput(
        rid="r2", input_ids=ids, sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        return_logprob=True, token_ids_logprob=[chosen]))
    driver.run()
    (report2,) = [o for b in driver.outputs for o in b.outputs if o.rid == "r2"]
    assert report2.logprobs.output_token_ids[0][0] == pytest.approx(report2.logprobs.output[0])
    assert report2.logprobs.input is None  # logprob_start_len -1: output logprobs only


def test_logprob_start_len_beyond_the_prompt_is_rejected(llama_path, prompts):
    driver = new_driver(llama_path)
    driver.submit("far", prompts[2], return_logprob=True, logprob_start_len=len(prompts[2]) + 1)
    driver.run()
    reason = driver.results()["far"].finished_reason
    assert reason["status_code"] == 400 and "logprob_start_len" in reason["message"]
