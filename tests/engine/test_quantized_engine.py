"""The Engine (real scheduler and detokenizer processes) serves an int8 or 4-bit model when asked
with ``quantization="int8"`` or ``"int4"``: its greedy tokens are the in-process runner's."""

from __future__ import annotations

import pytest

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS
from tests.model_executor.harness import ManualSlots, make_runner

PROMPTS = [[5, 9, 30, 41, 7, 100, 3], [8, 2, 77]]


def greedy(runner, prompts: list[list[int]], steps: int,
           slots_type: type[ManualSlots] = ManualSlots) -> list[list[int]]:
    """Greedy tokens of an in-process runner (``slots_type`` puts its batches on its device)."""
    slots = slots_type(runner)
    seqs = [slots.new_seq() for _ in prompts]
    tokens = runner.forward(slots.extend(seqs, prompts)).argmax(-1).tolist()
    out = [[t] for t in tokens]
    for _ in range(steps - 1):
        tokens = runner.forward(slots.decode(seqs, tokens)).argmax(-1).tolist()
        for row, t in zip(out, tokens, strict=True):
            row.append(t)
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_serves_with_the_quantization_flag(llama_path, strict_env, quantization):
    with Engine(model_path=llama_path, dtype="bfloat16", quantization=quantization,
                **ENGINE_KWARGS) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    runner = make_runner(llama_path, dtype="bfloat16", quantization=quantization)
    expected = greedy(runner, PROMPTS, 6)
    assert [o["output_ids"] for o in outs] == expected
