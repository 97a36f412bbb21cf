"""CUDA graphs with LoRA, the device-independent part on CPU: the adapter-slot buffers that are
the graphs' LoRA inputs (one segment per row, padding rows without an adapter), and the
ModelRunner replaying decode batches that mix adapters and the base model through the graph
runner's static buffers (on CPU the "graph" runs the forward on them) exactly as the eager
forward does. The GPU check (tests/cuda/test_cuda_lora.py) replays real graphs."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.lora.graph_inputs import PAD_LORA_SLOT, LoRAGraphInputs
from radixserve.model_executor.cpu_graph_runner import CpuGraphRunner
from tests.layers.helpers import require_kernels
from tests.lora.adapters import make_adapter
from tests.model_executor.harness import ManualSlots, make_runner


def test_graph_inputs_hold_each_rows_slot_and_pad_without_an_adapter():
    inputs = LoRAGraphInputs(8, "cpu")
    assert inputs.seg_starts.tolist() == list(range(8))
    inputs.write([2, -1, 0], bs=3, padded=4)
    assert inputs.token_slots[:4].tolist() == [2, -1, 0, PAD_LORA_SLOT]
    assert inputs.seg_lens[:4].tolist() == [1, 0, 1, 0]
    info = inputs.info(4)
    assert info.static and info.any_adapter and info.max_seg_len == 1
    assert info.seg_slots.data_ptr() == inputs.token_slots.data_ptr()  # views, not copies
    inputs.write(None, bs=2, padded=2)  # a batch of the base model only
    assert inputs.token_slots[:2].tolist() == [-1, -1] and inputs.seg_lens[:2].tolist() == [0, 0]
    assert info.token_slots[:2].tolist() == [-1, -1]  # the captured view sees the new values
    with pytest.raises(ValueError, match="2 LoRA slots for a batch of 3"):
        inputs.write([0, 1], bs=3, padded=4)
    with pytest.raises(ValueError, match="captured up to 8"):
        inputs.write(None, bs=3, padded=9)


@pytest.fixture(scope="module")
def lora_runner(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-adapters")
    paths = [
        f"attn={make_adapter(llama_path, root / 'attn', 4, ['q_proj', 'v_proj', 'o_proj'], 21)}",
        f"mlp={make_adapter(llama_path, root / 'mlp', 8, ['gate_proj', 'down_proj'], 22)}",
    ]
    runner = make_runner(llama_path, max_total_tokens=1024, enable_lora=True, lora_paths=paths,
                         max_loras_per_batch=2, max_lora_rank=8)
    runner.cuda_graph_batch_sizes = [1, 2, 4, 8]
    runner._capture_graphs()
    return runner


def _with_slots(fb: ForwardBatch, slots: list[int]) -> ForwardBatch:
    return dataclasses.replace(fb, lora_slots=slots)


def _eager_and_base(runner, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``fb``'s logits from the eager forward, with its adapters and on the base model alone
    (each rewrites the same KV slots with the same values); the graphs are set aside meanwhile."""
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        return runner.forward(fb), runner.forward(_with_slots(fb, None))
    finally:
        runner.graph_runner = graphs


def test_decode_mixing_adapters_replays_the_graphs_as_the_eager_forward(lora_runner):
    runner, graphs = lora_runner, lora_runner.graph_runner
    assert graphs is not None and graphs.lora_inputs is not None
    attn, mlp = runner.lora.slot_of["attn"], runner.lora.slot_of["mlp"]
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (7, 3, 12, 5, 9)]
    per_req = [attn, -1, mlp, attn, mlp]
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    logits = runner.forward(_with_slots(slots.extend(seqs, prompts), per_req))
    replays = []
    replay = graphs.replay
    graphs.replay = lambda fb: replays.append(fb.batch_size) or replay(fb)
    for step in range(3):
        # 5 requests (padded to 8), then 3 (padded to 4) whose adapters change places
        live = len(seqs) if step < 2 else 3
        mix = per_req[:live] if step < 2 else [mlp, attn, -1]
        fb = _with_slots(slots.decode(seqs[:live], logits[:live].argmax(-1).tolist()), mix)
        graphed = runner.forward(fb)
        padded = graphs.padded_batch_size(live)
        assert graphs.lora_inputs.token_slots[:padded].tolist() == mix + [-1] * (padded - live)
        eager, base = _eager_and_base(runner, fb)
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=0)
        # the adapters change the logits: a graph that ignored its LoRA inputs would fail
        differs = (graphed - base).abs().amax(-1) > 1e-4
        assert differs.tolist() == [s >= 0 for s in mix]
        logits = graphed
    assert replays == [5, 5, 3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_graphs_trace_lora_for_any_mix_and_adapters_loaded_after(
    dtype, llama_path, tmp_path_factory
):
    """On CPU the decode steps with LoRA run from traced graphs (``CpuGraphRunner``): each
    replay must compute what the eager step computes, bit for bit, whichever adapters its rows
    use (not those of the batch it was traced on, nor none), and after an adapter is loaded into
    a slot or unloaded from one (the kernel's copies of the pool are rewritten in place)."""
    require_kernels()  # CPU graphs need the cpu attention backend: the AVX-512 kernels
    root = tmp_path_factory.mktemp(f"cpu-graph-adapters-{dtype}")
    paths = [
        f"attn={make_adapter(llama_path, root / 'attn', 4, ['q_proj', 'v_proj', 'o_proj'], 21)}",
        f"mlp={make_adapter(llama_path, root / 'mlp', 8, ['gate_proj', 'down_proj'], 22)}",
    ]
    late = make_adapter(llama_path, root / "late", 8, ["q_proj", "k_proj", "up_proj"], 23)
    runner = make_runner(llama_path, dtype=dtype, max_total_tokens=1024, enable_lora=True,
                         lora_paths=paths, max_loras_per_batch=3, max_lora_rank=8,
                         lora_target_modules=["all"])
    graphs = runner.graph_runner
    assert isinstance(graphs, CpuGraphRunner) and graphs.lora_inputs is not None
    manager = runner.lora
    attn, mlp = manager.slot_of["attn"], manager.slot_of["mlp"]
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (7, 3, 12, 5, 9)]
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    logits = runner.forward(_with_slots(slots.extend(seqs, prompts), [attn, -1, mlp, attn, mlp]))
    last = logits.argmax(-1).tolist()  # each request's next token
    plan: list[tuple[str | None, list[int]]] = [
        (None, [attn, -1, mlp, attn, mlp]),  # traces bucket 8
        (None, [mlp, mlp, -1, attn, -1]),  # replays it for another mix
        (None, [-1, -1, -1]),  # traces bucket 4 on base-model rows only
        ("load", ["late", attn, -1]),  # replays it with adapters, one loaded after its trace
        (None, ["late", "late", mlp, -1, attn]),
        ("unload", ["late", attn, -1, "late", attn]),  # mlp's slot zeroed
    ]
    for step, (change, names) in enumerate(plan):
        if change == "load":
            manager.load("late", str(late))
        elif change == "unload":
            manager.unload("mlp")
        mix = [manager.slot_of[n] if isinstance(n, str) else n for n in names]
        live = len(mix)
        fb = _with_slots(slots.decode(seqs[:live], last[:live]), mix)
        graphed = runner.forward(fb)
        eager, base = _eager_and_base(runner, fb)
        assert torch.equal(graphed, eager), f"step {step}: {(graphed - eager).abs().max()}"
        differs = (graphed.float() - base.float()).abs().amax(-1) > 1e-4
        assert differs.tolist() == [s >= 0 for s in mix], f"step {step}"
        last[:live] = graphed.argmax(-1).tolist()
    assert sorted(graphs.traced) == [4, 8]
