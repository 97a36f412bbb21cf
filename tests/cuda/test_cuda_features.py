"""Round three's features on the GPU, each through a real Engine (scheduler and detokenizer
processes) with CUDA's defaults (triton attention, fused ops, CUDA graphs, the overlap
schedule): the parts of them that only a GPU runs.

- the hierarchical cache, whose host tier is pinned memory there, copied to and from the device
  pool: an evicted prefix comes back from it with the output of a cold prefill;
- a quantized KV cache read by the Triton kernels inside the CUDA graphs: the tokens of the
  torch_native reader of the same codes and scales;
- n-gram speculative decoding (verify steps run as extends beside graphed decodes): the tokens
  of plain decoding, with drafts accepted;
- structured outputs: xgrammar's token bitmask applied to logits on the GPU.
"""

from __future__ import annotations

import json
import random

import pytest

from radixserve import Engine
from tests.cuda.helpers import DEVICE, DeviceSlots, make_runner, requires_device
from tests.engine.conftest import wait_idle
from tests.engine.test_quantized_engine import greedy
from tests.managers.speculative_helpers import repetitive_prompts

pytestmark = requires_device
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def _engine(path, **kwargs) -> Engine:
    kwargs.setdefault("max_total_tokens", 8192)
    kwargs.setdefault("max_running_requests", 8)
    return Engine(model_path=str(path), device=DEVICE, dtype="float32", **kwargs)


def _doc(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_hierarchical_cache_brings_an_evicted_prefix_back_from_host_memory(llama64_path,
                                                                        strict_env):
    prompts = [_doc(seed) + [7, seed] for seed in range(4)]
    with _engine(llama64_path, max_total_tokens=512, page_size=4) as eng:
        cold = [eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
                for p in prompts]
    with _engine(llama64_path, max_total_tokens=512, page_size=4,
                 enable_hierarchical_cache=True, hicache_ratio=4.0,
                 hicache_write_policy="write_back") as eng:
        for p, ref in zip(prompts, cold, strict=True):  # the last three push the first out
            assert eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] == ref
        again = eng.generate(input_ids=prompts[0], sampling_params=GREEDY)
        state = wait_idle(eng)
    assert again["output_ids"] == cold[0]
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] >= 192, details
    assert state["memory"]["hicache_loaded_host_tokens"] >= 192, state["memory"]
    assert state["last_leak_check"]["ok"], state["last_leak_check"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_in_graphs_matches_torch_native(llama64_path, kv_cache_dtype):
    prompts = [[5, 9, 30, 41, 7, 100, 3], [8, 2, 77], _doc(1, 40)]
    with _engine(llama64_path, kv_cache_dtype=kv_cache_dtype) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                      sampling_params=GREEDY)]
        info = eng.get_server_info()
    assert info["kv_cache_dtype"] == kv_cache_dtype
    runner = make_runner(llama64_path, kv_cache_dtype=kv_cache_dtype,
                         attention_backend="torch_native", disable_cuda_graph=True)
    assert runner.token_to_kv_pool.quantized
    assert outs == greedy(runner, prompts, GREEDY["max_new_tokens"], DeviceSlots)


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(llama64_path, strict_env):
    prompts = repetitive_prompts()
    params = {"temperature": 0.0, "max_new_tokens": 32}
    with _engine(llama64_path) as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                       sampling_params=params)]
    with _engine(llama64_path, speculative_algorithm="NGRAM",
                 speculative_num_draft_tokens=6, speculative_max_batch_size=16) as eng:
        spec = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                      sampling_params=params)]
        state = wait_idle(eng)
    assert spec == plain
    assert state["spec_num_accepted_drafts"] > 0, state
    assert state["last_leak_check"]["ok"], state["last_leak_check"]


def test_json_schema_output_on_the_gpu_is_valid(llama64_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    with _engine(llama64_path, constrained_json_max_whitespace_cnt=2) as eng:
        outs = eng.generate(prompt=["a b c", "hello"], sampling_params={
            "temperature": 0.0, "max_new_tokens": 64, "json_schema": json.dumps(schema)})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        value = json.loads(out["text"])
        assert set(value) == {"n", "ok"} and isinstance(value["n"], int)
        assert isinstance(value["ok"], bool)
