"""The GPU check's summary table (``benchmarks/gpu_table.py``) from JSON lines of the shape the
benchmarks write: ms per step from decode tokens/s, the ratio to the graphed plain-torch step,
and the issue's targets judged per row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_table import table  # noqa: E402


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_reads_both_benchmarks_and_judges_the_targets(tmp_path):
    _write(tmp_path / "small.offline.jsonl", [
        {"model": "small", "device": "cuda"},
        {"backend": "radixserve", "scenario": "decode", "batch_size": 1,
         "decode_tokens_per_s": 1000.0},  # 1.0 ms: under the 1.3 ms target
        {"backend": "transformers", "scenario": "decode", "batch_size": 1,
         "decode_tokens_per_s": 20.0},
        {"backend": "radixserve", "scenario": "decode", "batch_size": 64,
         "decode_tokens_per_s": 32000.0},  # 2.0 ms: under 40,000 tok/s
        {"backend": "radixserve", "scenario": "prefill", "batch_size": 1,
         "input_tokens": 2048, "prefill_tokens_per_s": 100000.0},
    ])
    _write(tmp_path / "small.graphed.jsonl", [
        {"scenario": "copy_bandwidth", "copy_gb_per_s": 2900.0},
        {"scenario": "graphed_plain_step", "batch_size": 1, "ms_per_step": 0.95,
         "bandwidth_floor_ms": 0.34},
        {"scenario": "graphed_plain_step", "batch_size": 64, "ms_per_step": 1.4,
         "bandwidth_floor_ms": 0.47},
    ])
    lines = table(tmp_path).splitlines()
    assert lines[2] == ("| small | 1 | 1.00 (1,000) | 50.00 | 0.95 | 0.34 | 0.95 | 1.30 | yes |")
    assert lines[3] == ("| small | 64 | 2.00 (32,000) | - | 1.40 | 0.47 | 0.70 | 1.60 | no |")
    assert "small prefill 2048 tokens, radixserve: 100,000 tok/s" in lines
    assert lines[-1] == "device copy bandwidth: 2900.0 GB/s"
