"""The GPU check's summary: one markdown table from the JSON lines that
``bench_offline_throughput.py`` and ``bench_graphed_step.py`` wrote into a folder
(``<label>.offline.jsonl`` and ``<label>.graphed.jsonl`` per model), with the issue's targets.

ms per decode step = batch / decode tokens per second (end-to-end wall time of the batch minus
its prefill-only run, so scheduler, sampling and detokenization are in it). ``vs graphed`` is the
graphed plain-torch step's time over radixserve's (target: at least 0.9).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (label, batch) -> the target in ms per step (None: none stated)
TARGET_MS = {("small", 1): 1.3, ("small", 64): 64 / 40_000 * 1e3,
             ("llama3-8b-shape", 1): 6.3, ("llama3-8b-shape", 64): 64 / 7_500 * 1e3}


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def table(folder: Path) -> str:
    rows = ["| model | batch | radixserve ms/step (tok/s) | transformers ms/step | graphed plain "
            "torch ms | bandwidth floor ms | vs graphed | target ms | met |",
            "|---|---|---|---|---|---|---|---|---|"]
    prefill = []
    for offline in sorted(folder.glob("*.offline.jsonl")):
        label = offline.name.removesuffix(".offline.jsonl")
        records = _lines(offline)
        graphed = {r["batch_size"]: r for r in _lines(folder / f"{label}.graphed.jsonl")
                   if r.get("scenario") == "graphed_plain_step"}

        def step_ms(backend: str, batch: int, records=records) -> float | None:
            for r in records:
                if (r.get("backend") == backend and r.get("scenario") == "decode"
                        and r["batch_size"] == batch and r["decode_tokens_per_s"]):
                    return 1e3 * batch / r["decode_tokens_per_s"]
            return None

        batches = sorted({r["batch_size"] for r in records if r.get("scenario") == "decode"})
        for b in batches:
            ours, theirs = step_ms("radixserve", b), step_ms("transformers", b)
            g = graphed.get(b, {})
            g_ms, floor = g.get("ms_per_step"), g.get("bandwidth_floor_ms")
            target = TARGET_MS.get((label, b))
            ratio = f"{g_ms / ours:.2f}" if g_ms and ours else "-"
            met = "-"
            if ours is not None and target is not None:
                met = "yes" if ours <= target and (g_ms is None or g_ms / ours >= 0.9) else "no"
            rows.append(
                f"| {label} | {b} | {_ms(ours)} ({b / ours * 1e3:,.0f}) | {_ms(theirs)} | "
                f"{_ms(g_ms)} | {_ms(floor)} | {ratio} | {_ms(target)} | {met} |"
                if ours else f"| {label} | {b} | - | {_ms(theirs)} | {_ms(g_ms)} | {_ms(floor)} "
                f"| - | {_ms(target)} | - |")
        for r in records:
            if r.get("scenario") == "prefill":
                prefill.append(f"{label} prefill {r['input_tokens']} tokens, {r['backend']}: "
                               f"{r['prefill_tokens_per_s']:,.0f} tok/s")
    bandwidth = [r for g in folder.glob("*.graphed.jsonl") for r in _lines(g)
                 if r.get("scenario") == "copy_bandwidth"]
    extra = prefill + [f"device copy bandwidth: {bandwidth[0]['copy_gb_per_s']} GB/s"
                       if bandwidth else "device copy bandwidth: not measured"]
    return "\n".join(rows + [""] + extra)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
