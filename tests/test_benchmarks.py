"""The offline, serving, sessions, constrained, token-bitmask, linear and parallel benchmarks
still run end to end, on a tiny test checkpoint and a few tokens. Their speed is not checked here
(that is what they print); their output shape and their own consistency checks are."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.model_config import ModelConfig
from tests.layers.helpers import HAS_KERNELS, require_kernels

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(script: str, *args: str) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_bench_serving_launches_a_server_and_compares_it_with_the_offline_engine(llama_path):
    served, offline, comparison = run_benchmark(
        "bench_serving.py", "--launch", str(llama_path), "--offline-baseline",
        "--num-requests", "4", "--concurrency", "4", "--input-len", "8", "--output-len", "6",
        "--dtype", "float32", "--server-flags", "--device cpu --stream-interval 2",
    )
    assert (served["completed"], served["failed"], served["errors"]) == (4, 0, [])
    assert served["total_output_tokens"] == offline["total_output_tokens"] == 24
    assert served["ttft_ms"]["p50"] > 0
    ratio = served["output_tokens_per_s"] / offline["output_tokens_per_s"]
    assert comparison["ratio"] == round(ratio, 3)


def test_bench_sessions_runs_every_mode_and_streaming_reuses_the_history(llama_path):
    lines = run_benchmark(
        "bench_sessions.py", "--model", str(llama_path), "--sessions", "2", "--turns", "3",
        "--new-tokens", "8", "--output-len", "4", "--vocab-high", "400", "--device", "cpu",
    )
    summary = {line["mode"]: line for line in lines if line.get("summary")}
    assert set(summary) == {"streaming", "resend", "resend-no-radix"}
    assert summary["streaming"]["cached_tokens_total"] > 0
    assert summary["resend-no-radix"]["cached_tokens_total"] == 0
    assert all(line["ttft_last_over_first"] > 0 for line in summary.values())
    assert lines[-1]["identical"] == 2  # float32: the same conversations in every mode


def test_bench_hicache_serves_reasked_documents_from_the_host_tier(llama_path):
    *servers, summary = run_benchmark(
        "bench_hicache.py", "--model", str(llama_path), "--docs", "4", "--doc-len", "192",
        "--question-len", "8", "--output-len", "4", "--rounds", "2", "--requests", "4",
        "--working-set-ratio", "2", "--page-size", "4", "--dtype", "float32", "--device", "cpu",
        "--vocab-high", "400",
    )
    by_name = {line["server"]: line for line in servers}
    assert by_name["hicache"]["reask_cached_tokens_by_tier"]["host"] > 0
    assert by_name["radix"]["reask_cached_tokens_by_tier"]["host"] == 0
    assert summary["same_outputs"]  # float32: loaded KV gives the recomputed outputs
    assert summary["reask_ttft_ratio"] > 0 and summary["throughput_ratio"] > 0


def test_bench_constrained_compares_json_schema_with_unconstrained_at_equal_length(llama_path):
    lines = run_benchmark(
        "bench_constrained.py", "--model", str(llama_path), "--batch-sizes", "1,3",
        "--input-len", "5", "--output-len", "6", "--items", "20", "--repeats", "2",
        "--dtype", "float32", "--device", "cpu",
    )
    *records, summary = lines
    # One line per run (each kind, batch size and repeat), printed as it ends.
    assert sorted((r["mode"], r["batch_size"], r["repeat"]) for r in records) == sorted(
        (mode, b, repeat) for mode in ("unconstrained", "json_schema") for b in (1, 3)
        for repeat in (0, 1))
    for r in records:
        assert r["all_cut_at_output_len"] and r["output_tokens"] == 6 * r["batch_size"]
    assert summary["num_cached_grammars"] == 1  # compiled once, before timing
    assert summary["ratio_batch_1"] > 0 and summary["ratio_batch_3"] > 0


def test_bench_sessions_offload_mode_measures_restore_recompute_and_resident(llama_path):
    lines = run_benchmark(
        "bench_sessions.py", "--offload", "--model", str(llama_path), "--histories", "48,96",
        "--reps", "2", "--new-tokens", "8", "--output-len", "4", "--vocab-high", "400",
        "--device", "cpu", "--offload-after", "0.2",
    )
    turns = [line for line in lines if "mode" in line]
    assert len(turns) == 2 * 2 * 3
    for line in turns:
        # The benchmark checks cached_tokens itself: the whole history unless recomputed.
        assert (line["cached_tokens"] == 0) == (line["mode"] == "recompute")
    summaries = [line for line in lines if line.get("summary")]
    assert [s["history"] for s in summaries] == [48, 96]
    assert all(s["stored_mb"] > 0 and s["restore_over_recompute"] > 0 for s in summaries)


def test_bench_parallel_times_each_topology_and_models_the_communication(llama_path):
    lines = run_benchmark(
        "bench_parallel.py", "--model", str(llama_path), "--topologies", "tp1,tp2,pp2",
        "--batch-sizes", "2", "--input-len", "5", "--output-len", "3", "--prefill-len", "16",
        "--repeats", "1", "--dtype", "float32",
    )
    records = [line for line in lines if "backend" in line]
    assert {(r["backend"], r["scenario"]) for r in records} == {
        (t, s) for t in ("tp1", "tp2", "pp2") for s in ("decode", "prefill")}
    assert all(r["output_tokens"] == 6 for r in records if r["scenario"] == "decode")
    ratios = {(r["ratio"], r["scenario"]) for r in lines if "ratio" in r}
    assert ratios == {(f"{t}/tp1", s) for t in ("tp2", "pp2") for s in ("decode", "prefill")}
    (model,) = [line["modelled"] for line in lines if "modelled" in line]
    layers, hidden = model["layers"], model["hidden_size"]
    assert model["tp_all_reduces_per_token"] == 2 * layers + 1
    assert model["pp_bytes_per_token_per_boundary"] == 2 * hidden * model["dtype_bytes"] + 8


def test_bench_token_bitmask_times_both_implementations_of_every_case():
    require_kernels()  # the kernel it compares
    lines = run_benchmark("bench_token_bitmask.py", "--batch", "3", "--vocab", "1000",
                          "--calls", "2", "--repeats", "1")
    assert sorted((r["dtype"], r["bitmask"]) for r in lines) == sorted(
        (dtype, mask) for dtype in ("bfloat16", "float32")
        for mask in ("all_forbidden", "half_random", "all_allowed"))
    for r in lines:
        assert r["xgrammar_ms"] > 0 and r["kernel_ms"] > 0 and r["argmax_ms"] > 0


@pytest.mark.parametrize("cold", [False, True])
def test_bench_linear_times_every_projection_of_a_layer_on_both_sides(llama_path, cold):
    require_kernels()  # the kernel it compares
    config = ModelConfig.from_path(str(llama_path))
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    qkv = q_size + 2 * config.num_key_value_heads * config.head_dim
    lines = run_benchmark("bench_linear.py", "--models", str(llama_path), "--batch-sizes", "1,3",
                          "--repeats", "1", "--calls", "3",
                          *(["--cold", "--cold-cache-mib", "4"] if cold else []))
    projections = [r for r in lines if "projection" in r]
    assert sorted((r["dtype"], r["batch_size"], r["projection"], r["n"], r["k"])
                  for r in projections) == sorted(
        (dtype, m, proj, n, k) for dtype in ("bf16", "fp32") for m in (1, 3)
        for proj, n, k in (("qkv_proj", qkv, hidden), ("o_proj", hidden, q_size),
                           ("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)))
    layers = [r for r in lines if r.get("comparison") == "layer_linears"]
    assert len(layers) == 4
    for r in projections + layers:
        assert r["cold"] is cold
    for r in projections:
        assert r["radixserve_gflops"] > 0 and r["torch_gflops"] > 0
        # the dispatch's choice is one of the candidates timed, judged against the fastest
        assert r["chosen"] in r["candidates_gflops"] and r["best"] in r["candidates_gflops"]
        assert "blocked" in r["candidates_gflops"] and "onednn" in r["candidates_gflops"]
        assert r["verdict"] in ("ok", "WRONG")
    for r in layers:
        assert r["radixserve_ms"] > 0 and r["torch_ms"] > 0 and r["speedup"] > 0


def test_bench_offline_throughput_times_each_scenario_and_the_step_overhead(llama_path):
    lines = run_benchmark(
        "bench_offline_throughput.py", "--model", str(llama_path), "--batch-sizes", "1,3",
        "--min-input-len", "4", "--max-input-len", "7", "--output-len", "5",
        "--prefill-len", "24", "--step-overhead", "--dtype", "float32",
    )
    overhead = [r for r in lines if r.get("scenario") == "step_overhead"]
    assert [r["batch_size"] for r in overhead] == [1, 3]
    assert all(r["decode_steps"] > 0 and r["ms_per_step"] > 0 for r in overhead)
    timed = {(r["backend"], r["scenario"], r["batch_size"]) for r in lines
             if r.get("scenario") in ("decode", "prefill")}
    assert timed == {(b, s, n) for b in ("radixserve", "transformers")
                     for s, n in (("decode", 1), ("decode", 3), ("prefill", 1))}
    decode = {r["batch_size"]: r for r in lines if r.get("comparison") == "decode"}
    # float32 greedy: every prompt's tokens equal transformers'
    assert {n: r["identical_outputs"] for n, r in decode.items()} == {1: 1, 3: 3}
    # which kernel each layer type runs per row bucket, as the engine chose it
    dispatch = {r["kernel_dispatch"]: r for r in lines if "kernel_dispatch" in r}
    if dispatch:  # printed where radixserve's linear kernel runs (AVX-512 or AVX2)
        # the prefill attention table only where the cpu attention backend runs (AVX-512)
        attention = dispatch.pop("attention_extend", None)
        assert (attention is not None) == HAS_KERNELS
        assert set(dispatch) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
        assert all(r["kind"] == "fp32" and r["kernels"].startswith("1") for r in dispatch.values())
        if attention is not None:
            # float32: the extend kernel unless this machine measured SDPA faster somewhere
            assert attention["kind"].startswith("attention:float32:")
            assert attention["kernels"].startswith("prefix 0: 16")
            assert attention["source"] == "measured" or "sdpa" not in attention["kernels"]


def test_bench_batched_prefill_times_before_after_and_transformers_on_the_same_prompts(
    llama_path,
):
    require_kernels()  # "before" is radixserve's kernels
    lines = run_benchmark(
        "bench_batched_prefill.py", "--model", str(llama_path), "--batch-sizes", "2,3",
        "--min-input-len", "4", "--max-input-len", "9", "--repeats", "1", "--profile",
        "--top", "3", "--dtype", "float32",
    )
    assert sorted((r["config"], r["batch_size"]) for r in lines) == sorted(
        (c, b) for c in ("before", "after", "transformers") for b in (2, 3))
    for r in lines:
        assert r["wall_s"] > 0 and 8 <= r["prompt_tokens"] <= 27
        assert len(r["profile_self_ms"]) == 3
        assert (r["config"] == "transformers") == ("vs_transformers" not in r)


def test_bench_offline_throughput_runs_a_gguf_file_in_both_engines(llama_path, tmp_path):
    """A GGUF --model: radixserve and transformers' own GGUF loader run the same file, and in
    float32 greedy they agree token for token. Where llama-cpp-python is installed (optional;
    not on CI) ``llamacpp`` (= llamacpp-file) runs the very file beside them (no second Engine
    start): the same token-id prompts, the same greedy outputs, and llama.cpp's own count of
    its decode calls (one per new token after the first)."""
    from tests.gguf_checkpoints import convert_checkpoint

    against = ["transformers"]
    if importlib.util.find_spec("llama_cpp") is not None:
        against.append("llamacpp")
    gguf = convert_checkpoint(llama_path, tmp_path / "tiny.gguf")
    lines = run_benchmark(
        "bench_offline_throughput.py", "--model", str(gguf), "--batch-sizes", "1,3",
        "--min-input-len", "4", "--max-input-len", "7", "--output-len", "6",
        "--prefill-len", "0", "--dtype", "float32",
        "--backends", ",".join(["radixserve", *against]),
    )
    assert lines[0]["model"] == "tiny.gguf" and lines[0]["path"] == str(gguf)
    decode = {(r["against"], r["batch_size"]): r["identical_outputs"]
              for r in lines if r.get("comparison") == "decode"}
    names = [b.replace("llamacpp", "llamacpp-file") for b in against]
    assert decode == {(b, n): n for b in names for n in (1, 3)}
    perf = {r["batch_size"]: r["decode_tokens"] for r in lines if "llamacpp_perf" in r}
    # the warm-up's two prompts of 4 new tokens, then the scenarios' 6 new tokens per prompt
    assert perf == ({2: 6, 1: 5, 3: 15} if "llamacpp" in against else {})


def test_bench_offline_throughput_refuses_a_plot_it_cannot_draw_before_it_runs(llama_path):
    """Without matplotlib (hidden from the benchmark here) ``--plot`` is an error at once, as is
    ``--plot`` with ``--shape-sweep``, whose runs it would not draw."""
    script = BENCHMARKS / "bench_offline_throughput.py"
    hide = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    for prefix, extra, message in (
        ([sys.executable, "-c", hide], [], "--plot needs matplotlib"),
        ([sys.executable], ["--shape-sweep"], "does not combine with --shape-sweep"),
    ):
        done = subprocess.run(
            [*prefix, str(script), "--model", str(llama_path), "--plot", "out.png", *extra],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert message in done.stderr
        assert not done.stdout  # nothing ran


def parse_offline_args(monkeypatch, capsys, *argv: str) -> tuple[int | None, str]:
    """``bench_offline_throughput.parse_args`` on ``argv`` in this process (nothing loads):
    (exit status or None, stderr)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_offline_throughput

    monkeypatch.setattr(sys, "argv", ["bench_offline_throughput.py", *argv])
    try:
        bench_offline_throughput.parse_args()
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return None, capsys.readouterr().err


def test_bench_offline_throughput_refuses_a_llamacpp_backend_it_cannot_run_before_it_runs(
    llama_path, tmp_path, monkeypatch, capsys
):
    """llama.cpp's backends are checked with the arguments: llamacpp-file needs a GGUF --model,
    the converting ones a checkpoint directory, and without llama-cpp-python (hidden here, as on
    CI) the error says how to install it, naming the backend the ``llamacpp`` alias became."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # only its name is read before the run
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    for model, backends, message in (
        (llama_path, "radixserve,llamacpp-file", "llamacpp-file runs a GGUF --model as it is"),
        (gguf, "radixserve,llamacpp-q8_0,llamacpp-bf16",
         "llamacpp-q8_0, llamacpp-bf16 convert a checkpoint directory"),
        (gguf, "radixserve,radixserve-int8,llamacpp-file",
         "llamacpp-file needs the llama_cpp module: pip install llama-cpp-python"),
        (gguf, "radixserve,llamacpp", "llamacpp-file needs the llama_cpp module"),
        (llama_path, "radixserve,llamacpp", "llamacpp-q8_0 needs the llama_cpp module"),
        (gguf, "radixserve,llamacpp-gguf", "unknown backend(s) ['llamacpp-gguf']"),
    ):
        code, err = parse_offline_args(monkeypatch, capsys, "--model", str(model),
                                       "--backends", backends)
        assert code == 2 and message in err, (backends, err)
    code, err = parse_offline_args(monkeypatch, capsys, "--model", str(gguf),
                                   "--backends", "radixserve,transformers")
    assert code is None and not err  # no llama.cpp backend asked for: nothing needed


def test_bench_kv_cache_quant_times_each_cache_dtype_and_sizes_its_pool(llama_path):
    lines = run_benchmark(
        "bench_kv_cache_quant.py", "--model", str(llama_path), "--dtype", "float32",
        "--kv-cache-dtypes", "auto,int8,fp8_e5m2", "--batch", "2", "--context", "40",
        "--steps", "2", "--rounds", "1", "--attention-backend", "torch_native",
        "--interleave", "3",
    )
    *runs, summary = lines
    assert [r["kv_cache_dtype"] for r in runs] == ["auto", "int8", "fp8_e5m2"]
    assert all(r["interleave"] == 3 for r in runs)
    assert [r["kv_storage"] for r in runs] == ["float32", "int8", "float8_e5m2"]
    assert all(r["decode_tokens_per_s"] > 0 and r["batch"] == 2 for r in runs)
    # float32 K/V against int8 codes plus a float32 scale per head, and fp8 codes alone
    assert 3.0 < runs[1]["tokens_per_budget_vs_first"] < 4.0
    assert runs[2]["tokens_per_budget_vs_first"] == 4.0
    assert set(summary["speedup"]) == {"auto", "int8", "fp8_e5m2"}


@pytest.mark.parametrize("interleave", [0, 1, 3])
def test_bench_kv_cache_quant_lays_slots_out_as_prefill_or_decode_would(interleave):
    """Every request gets its own slots, all inside the pool it sizes; one run each, or runs of
    ``interleave`` positions taking turns between the requests (decode at page size 1: a
    request's consecutive positions are the batch size apart)."""
    spec = importlib.util.spec_from_file_location(
        "bench_kv_cache_quant", BENCHMARKS / "bench_kv_cache_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    batch, row_len, first = 4, 10, 1
    table = bench.slot_table(batch, row_len, interleave, first)
    assert table.shape == (batch, row_len)
    slots = table.flatten().tolist()
    assert len(set(slots)) == len(slots)
    assert min(slots) >= first
    assert max(slots) < first + batch * bench.pool_rows(row_len, interleave)
    steps = (table[:, 1:] - table[:, :-1]).flatten().tolist()
    if interleave == 0:
        assert set(steps) == {1}
    elif interleave == 1:
        assert set(steps) == {batch}
    else:  # within a run 1; from one of a request's runs to its next, the other requests' runs
        assert set(steps) == {1, (batch - 1) * interleave + 1}


@pytest.mark.parametrize("decode_run", [1, 8])
def test_bench_kv_cache_quant_takes_the_decode_layout_from_the_allocator(decode_run):
    """--decode-run: the prompts prefilled back to back, then the allocator's decode slots:
    the batch size apart without runs, runs of decode_run with them; all inside the pool."""
    spec = importlib.util.spec_from_file_location(
        "bench_kv_cache_quant", BENCHMARKS / "bench_kv_cache_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    batch, row_len = 4, bench.PROMPT + 40
    size = batch * (row_len + decode_run * (1 + bench.PARK_HEADROOM))
    table = bench.allocator_table(batch, row_len, decode_run, size)
    slots = table.flatten().tolist()
    assert len(set(slots)) == len(slots) and 1 <= min(slots) and max(slots) <= size
    prompt = table[:, : bench.PROMPT]
    assert torch.equal(prompt.flatten(), torch.arange(1, batch * bench.PROMPT + 1))
    steps = (table[:, bench.PROMPT + 1 :] - table[:, bench.PROMPT : -1]).tolist()
    for row in steps:
        if decode_run == 1:
            assert set(row) == {batch}
        else:  # 40 tokens: runs of 8, the next run elsewhere
            assert row.count(1) == 35


def test_a_decode_too_short_to_time_gives_no_rate_and_no_ratio(monkeypatch):
    """When the prefill-only run took as long as the whole run (noise, or a first batch that
    paid a JIT compile), the decode rate is null, not a division by almost nothing, and so is
    its ratio; the end-to-end figure stays."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_offline_throughput as bench

    short = bench.decode_record("radixserve", [[1, 2]], [[3, 4, 5]], wall_s=0.01,
                                prefill_wall_s=0.02)
    other = bench.decode_record("transformers", [[1, 2]], [[3, 4, 5]], wall_s=0.03,
                                prefill_wall_s=0.01)
    assert short["decode_tokens_per_s"] is None and other["decode_tokens_per_s"] == 100.0
    outputs = {"radixserve": {1: [[3, 4, 5]]}, "transformers": {1: [[3, 4, 5]]}}
    [row] = bench.comparisons([short, other], "radixserve", "transformers", outputs)
    assert row["speedup_decode"] is None and row["speedup_output"] == 3.0
    assert row["identical_outputs"] == 1
