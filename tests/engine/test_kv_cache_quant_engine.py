"""A quantized KV cache end to end: the Engine (real scheduler and detokenizer processes) with
``kv_cache_dtype="int8"`` and ``"fp8_e4m3"`` on the cpu attention backend generates, token for
token, what an in-process runner over the same quantized pool generates with the torch_native
backend (a different reader of the same codes and scales); the flag parses; the KV planner fits
~1.9x the tokens of a bf16 cache into the same memory."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.cli import build_parser, server_args_from_namespace
from radixserve.model_executor import model_runner
from tests.checkpoints import kv_scales_of
from tests.engine.conftest import ENGINE_KWARGS
from tests.engine.test_quantized_engine import PROMPTS, greedy
from tests.layers.helpers import needs_kernels
from tests.model_executor.harness import make_runner
from tests.model_executor.test_kv_scales import layer_count, scales_file


@needs_kernels  # the cpu attention backend
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_engine_with_a_quantized_kv_cache_matches_torch_native(llama_path, strict_env,
                                                               kv_cache_dtype):
    with Engine(model_path=llama_path, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                attention_backend="cpu", **ENGINE_KWARGS) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
        info = engine.get_server_info()
    assert info["kv_cache_dtype"] == kv_cache_dtype
    runner = make_runner(llama_path, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                         attention_backend="torch_native")
    assert runner.token_to_kv_pool.quantized
    assert [o["output_ids"] for o in outs] == greedy(runner, PROMPTS, 12)


@needs_kernels  # the cpu attention backend
def test_engine_over_a_calibrated_checkpoint_reads_its_kv_scales(calibrated_path, strict_env):
    """A checkpoint with a k_scale and v_scale per layer served with an fp8 KV cache: the
    Engine's cpu kernels (prefill and decode, CPU graphs) read each layer's codes under its
    scales as the torch_native backend of an in-process runner does, token for token."""
    with Engine(model_path=calibrated_path, dtype="float32", kv_cache_dtype="fp8_e4m3",
                attention_backend="cpu", **ENGINE_KWARGS) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
    runner = make_runner(calibrated_path, dtype="float32", kv_cache_dtype="fp8_e4m3",
                         attention_backend="torch_native")
    assert runner.token_to_kv_pool.layer_scales == kv_scales_of(
        len(runner.token_to_kv_pool.k_buffer))
    assert [o["output_ids"] for o in outs] == greedy(runner, PROMPTS, 12)


@needs_kernels  # the cpu attention backend
def test_engine_reads_a_quantization_param_file(llama_path, tmp_path, strict_env):
    """--quantization-param-path reaches the scheduler's runner: the Engine's cpu kernels over
    the file's scales generate what a torch_native runner over the same file does. The scales
    are small enough to clip K and V (at most 448 times the scale), so a server that left the
    file unread would generate what the unit-scale runner does, which differs."""
    layers = layer_count(llama_path)
    scales = [0.0015 * (layer + 1) for layer in range(layers)]
    path = scales_file(tmp_path / "kv.json", [scales])
    kwargs = {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"}
    runner = make_runner(llama_path, attention_backend="torch_native",
                         quantization_param_path=str(path), **kwargs)
    assert runner.token_to_kv_pool.layer_scales == [(s, s) for s in scales]
    unit = make_runner(llama_path, attention_backend="torch_native", **kwargs)
    expected = greedy(runner, PROMPTS, 12)
    assert expected != greedy(unit, PROMPTS, 12)
    kwargs["quantization_param_path"] = str(path)
    with Engine(model_path=llama_path, attention_backend="cpu", **kwargs,
                **ENGINE_KWARGS) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == expected


def test_kv_cache_dtype_flag(tmp_path):
    path = scales_file(tmp_path / "kv.json", [[1.0]])
    ns = build_parser().parse_args(["serve", "--model-path", "m", "--kv-cache-dtype", "fp8_e5m2",
                                    "--quantization-param-path", str(path)])
    args = server_args_from_namespace(ns)
    assert (args.kv_cache_dtype, args.quantization_param_path) == ("fp8_e5m2", str(path))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-path", "m", "--kv-cache-dtype", "q4_0"])


def test_planner_fits_about_twice_the_tokens(llama_path, monkeypatch):
    """Same memory budget: an int8 pool holds bf16's tokens times 2 * head_dim / (head_dim + 4)
    (codes plus a float32 scale per head against two bytes per element), an fp8 pool (one
    scale per layer) exactly twice them."""
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 2 << 30)
    tokens = {}
    for name in ("bf16", "int8", "fp8_e4m3"):
        runner = make_runner(llama_path, dtype="float32", kv_cache_dtype=name,
                             max_total_tokens=None, mem_fraction_static=0.01)
        tokens[name] = runner.max_total_num_tokens
    head_dim = runner.token_to_kv_pool.head_dim
    ratio = tokens["int8"] / tokens["bf16"]
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 4), rel=1e-3)
    assert tokens["fp8_e4m3"] / tokens["bf16"] == pytest.approx(2, rel=1e-3)
