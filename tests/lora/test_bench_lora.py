"""benchmarks/bench_lora.py runs end to end on the tiny checkpoint (its speed is what it prints,
not checked here)."""

from __future__ import annotations

from tests.test_benchmarks import run_benchmark


def test_bench_lora_times_base_lora_and_loading(llama_path):
    lines = run_benchmark(
        "bench_lora.py", "--model", str(llama_path), "--batch-size", "4", "--num-adapters",
        "2", "--rank", "2", "--input-len", "6", "--output-len", "3", "--repeats", "1",
        "--dtype", "float32",
    )
    by = {line.get("scenario") or line.get("comparison"): line for line in lines}
    assert by["base"]["output_tokens"] == by["lora"]["output_tokens"] == 4 * 3
    assert by["base_alone"]["output_tokens"] == 4 * 3 and by["base_alone"]["num_adapters"] == 0
    assert by["lora"]["num_adapters"] == 2
    assert by["load"]["load_idle_ms"] > 0 and by["load"]["load_while_serving_ms"] > 0
    assert by["lora_vs_base"]["ratio"] > 0 and by["lora_vs_base"]["ratio_vs_base_alone"] > 0
