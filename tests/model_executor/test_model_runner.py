"""ModelRunner construction: KV memory sizing, pools and allocator, dtypes, idle batches."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.model_executor.model_loader import checkpoint_weight_bytes
from tests.model_executor.harness import ManualSlots, make_runner


def test_max_total_tokens_is_rounded_down_to_whole_pages(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="radixserve.model_executor.model_runner"):
        runner = make_runner(llama_path, max_total_tokens=1000, page_size=16)
    assert runner.max_total_num_tokens == 992
    assert runner.page_size == 16
    assert runner.max_running_requests == 256
    assert runner.vocab_size == 512
    allocator = runner.token_to_kv_pool_allocator
    assert (allocator.size, allocator.page_size) == (992, 16)
    assert allocator.available_size() == 992
    assert runner.token_to_kv_pool.get_key_buffer(0).shape == (992 + 16, 2, 16)
    assert runner.req_to_token_pool.req_to_token.shape == (256, 1024)
    assert "KV cache: 992 tokens" in caplog.text


def test_request_slots_follow_max_running_requests_and_context_length(llama_path):
    runner = make_runner(llama_path, max_total_tokens=64, max_running_requests=3,
                         context_length=100)
    assert runner.max_running_requests == 3
    assert runner.req_to_token_pool.req_to_token.shape == (3, 100)
    assert make_runner(llama_path, max_total_tokens=64).max_running_requests == 64


def test_mem_fraction_sizes_kv_from_available_memory_after_weights(llama_path):
    fraction = 1e-3
    before = psutil.virtual_memory().available
    runner = make_runner(llama_path, max_total_tokens=None, mem_fraction_static=fraction,
                         page_size=4)
    cfg = runner.model_config
    per_token = MHATokenToKVPool.bytes_per_token(
        cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, torch.float32
    )
    weights = checkpoint_weight_bytes(cfg, torch.float32)
    assert weights == sum(p.numel() * 4 for p in runner.model.parameters())
    expected = (before - weights) * fraction / per_token
    assert runner.max_total_num_tokens % 4 == 0
    # Other processes change the available memory a little between the two readings.
    assert runner.max_total_num_tokens == pytest.approx(expected, rel=0.2)
    assert runner.token_to_kv_pool_allocator.size == runner.max_total_num_tokens


def test_a_device_without_traits_is_refused_naming_the_known_ones(llama_path):
    from radixserve.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner, RunnerSettings

    config = ModelConfig.from_path(llama_path, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"no model runner for device 'meta'; known: \['cpu', "):
        ModelRunner(config, RunnerSettings(max_total_tokens=64), "meta")


def test_kv_cache_smaller_than_a_page_is_rejected(llama_path):
    with pytest.raises(ValueError, match="not enough memory for a KV cache of one page"):
        make_runner(llama_path, max_total_tokens=8, page_size=16)


def test_empty_batch_returns_empty_logits(llama_path):
    runner = make_runner(llama_path)
    empty = torch.empty(0, dtype=torch.int64)
    fb = ForwardBatch(ForwardMode.DECODE, empty, empty, empty, empty, empty, seq_lens_cpu=[])
    assert runner.forward(fb).shape == (0, 512)


def test_bfloat16_model_returns_bfloat16_logits_near_float32_model(llama_path):
    prompts = [[5, 9, 30, 41, 7, 100], [12, 13, 14]]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(llama_path, dtype=dtype)
        assert runner.model.lm_head.weight.dtype == getattr(torch, dtype)
        assert runner.token_to_kv_pool.get_key_buffer(0).dtype == getattr(torch, dtype)
        slots = ManualSlots(runner)
        seqs = [slots.new_seq() for _ in prompts]
        runner.forward(slots.extend(seqs, prompts))
        logits[dtype] = runner.forward(slots.decode(seqs, [3, 4]))
    assert logits["bfloat16"].dtype == torch.bfloat16  # the sampler upcasts when it must
    torch.testing.assert_close(logits["bfloat16"].float(), logits["float32"], atol=0.05, rtol=0.05)
