"""The scheduler's greedy outputs equal transformers', whatever the batching and memory setup."""

from __future__ import annotations

import pytest

from tests.checkpoints import ARCHITECTURES
from tests.managers.conftest import (
    MAX_NEW_TOKENS,
    PROMPT_LENS,
    assert_matches_reference,
    hf_reference,
    make_prompts,
    new_driver,
)

# Each configuration stresses one mechanism; all must reproduce transformers exactly.
CONFIGS = {
    "page16": {"page_size": 16},
    "chunked": {"chunked_prefill_size": 16},
    "page16_chunked": {"page_size": 16, "chunked_prefill_size": 32},
    "no_radix": {"disable_radix_cache": True, "chunked_prefill_size": 16},
    # A pool far smaller than the batch needs, admission reserving almost nothing: decode runs
    # out of KV and must retract.
    "retract": {"max_total_tokens": 192, "schedule_conservativeness": 0.01},
    "retract_page16_no_radix": {
        "max_total_tokens": 192,
        "page_size": 16,
        "schedule_conservativeness": 0.01,
        "disable_radix_cache": True,
    },
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_run(request, checkpoint_factory):
    """One batch of mixed-length prompts per architecture, with logprobs."""
    path = checkpoint_factory(request.param)
    driver = new_driver(path)
    prompts = make_prompts(driver.scheduler.model_config.vocab_size)
    results = driver.generate(
        {f"p{i}": ids for i, ids in enumerate(prompts)}, return_logprob=True
    )
    return results, hf_reference(path, prompts)


def test_greedy_batch_matches_transformers_token_for_token(arch_run):
    results, refs = arch_run
    assert len(results) == len(PROMPT_LENS)
    for i, ref in enumerate(refs):
        assert_matches_reference(results[f"p{i}"], ref)


def test_output_logprobs_match_transformers_log_softmax(arch_run):
    results, refs = arch_run
    for i, ref in enumerate(refs):
        result = results[f"p{i}"]
        assert len(result.logprobs) == len(result.tokens)
        assert_matches_reference(result, ref, check_logprobs=True)


def test_finish_reasons_are_length_or_eos(arch_run):
    results, _ = arch_run
    for result in results.values():
        reason = result.finished_reason
        assert reason is not None
        if reason["type"] == "length":
            assert reason["length"] == MAX_NEW_TOKENS == len(result.tokens)
        else:
            assert reason == {"type": "stop", "matched": result.tokens[-1]}


@pytest.fixture(scope="module", params=list(CONFIGS))
def config_run(request, llama_path):
    driver = new_driver(llama_path, **CONFIGS[request.param])
    prompts = make_prompts(driver.scheduler.model_config.vocab_size)
    results = driver.generate({f"p{i}": ids for i, ids in enumerate(prompts)})
    return request.param, driver, results, hf_reference(llama_path, prompts)


def test_greedy_matches_transformers_under_each_memory_config(config_run):
    _, _, results, refs = config_run
    for i, ref in enumerate(refs):
        assert_matches_reference(results[f"p{i}"], ref)


def test_only_the_small_pools_retract_and_nothing_is_aborted(config_run):
    name, driver, results, _ = config_run
    assert (driver.scheduler.num_retracted_reqs > 0) == name.startswith("retract")
    assert all(r.finished_reason["type"] != "abort" for r in results.values())


def test_same_prompt_twice_reuses_cache_with_identical_output(llama_path):
    driver = new_driver(llama_path, page_size=4)
    prompt = make_prompts(driver.scheduler.model_config.vocab_size, (37,), seed=1)[0]
    first = driver.generate({"a": prompt})["a"]
    second = driver.generate({"b": prompt})["b"]
    assert first.cached_tokens == 0
    # Everything but the last token (it is recomputed for logits), page aligned.
    assert second.cached_tokens == 36
    assert second.tokens == first.tokens


def test_stream_reports_every_step_and_non_stream_once(llama_path):
    driver = new_driver(llama_path)
    prompt = make_prompts(driver.scheduler.model_config.vocab_size, (12,), seed=2)[0]
    driver.submit("s", prompt, stream=True, ignore_eos=True)
    driver.submit("n", prompt, ignore_eos=True)
    driver.run()
    results = driver.results()
    assert results["s"].num_outputs == MAX_NEW_TOKENS
    assert results["n"].num_outputs == 1
    assert results["s"].tokens == results["n"].tokens
    assert results["n"].completion_tokens == MAX_NEW_TOKENS
    assert results["n"].prompt_tokens == 12


def test_stream_interval_reports_first_token_then_every_n_tokens_and_the_end(llama_path):
    driver = new_driver(llama_path, stream_interval=4)
    prompt = make_prompts(driver.scheduler.model_config.vocab_size, (12,), seed=2)[0]
    driver.submit("s", prompt, stream=True, ignore_eos=True, max_new_tokens=10)
    driver.submit("n", prompt, ignore_eos=True, max_new_tokens=10)
    driver.run()
    reported = [len(o.new_token_ids) for batch in driver.outputs for o in batch.outputs
                if o.rid == "s"]
    assert reported == [1, 4, 4, 1]  # tokens 1, 2-5, 6-9, 10 (the finish)
    results = driver.results()
    assert results["s"].tokens == results["n"].tokens


def test_a_request_stream_interval_overrides_the_servers(llama_path):
    driver = new_driver(llama_path, stream_interval=4)
    prompt = make_prompts(driver.scheduler.model_config.vocab_size, (12,), seed=2)[0]
    driver.submit("own", prompt, stream=True, ignore_eos=True, max_new_tokens=10,
                  stream_interval=3)
    driver.submit("server", prompt, stream=True, ignore_eos=True, max_new_tokens=10)
    driver.run()
    reported = {rid: [len(o.new_token_ids) for batch in driver.outputs for o in batch.outputs
                      if o.rid == rid] for rid in ("own", "server")}
    assert reported == {"own": [1, 3, 3, 3], "server": [1, 4, 4, 1]}
