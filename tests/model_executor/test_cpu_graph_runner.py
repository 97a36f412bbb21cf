"""CPU graphs (``cpu_graph_runner.py``): a traced decode step computes what the eager one does,
on every model shape whose Python decisions depend on the batch size alone (windows, soft caps,
q/k norms, int8 KV, int8 and int4 weights), as the batch's values change under it (lengths,
positions, KV slots, rows, batch sizes padded to a bucket); buckets are traced at first use;
the runner traces only where a trace is right and drops its graphs when the weights change."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.model_executor.cpu_graph_runner import CpuGraphRunner
from tests.checkpoints import build_checkpoint
from tests.layers.helpers import needs_kernels
from tests.model_executor.harness import ManualSlots, make_runner

CASES = {
    "llama": ("llama", {}, {}),
    "qwen3": ("qwen3", {}, {}),  # q/k norms
    "gemma2": ("gemma2", {}, {}),  # a window of 8 (shorter than the prompts), soft caps
    "llama-int8-kv-pages": ("llama", {}, {"kv_cache_dtype": "int8", "page_size": 4}),
    "qwen2-int8": ("qwen2", {}, {"quantization": "int8"}),
    "llama-int4": ("llama", {}, {"quantization": "int4"}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(arch: str, overrides: dict):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]

    return get


def _decode_run(runner, prompts: list[list[int]], steps: list[int]) -> list[torch.Tensor]:
    """Prefill ``prompts``, then greedy decode steps over the first ``steps[i]`` requests; the
    logits of every step. The KV pages are handed out in a shuffled order (the same for every
    runner), so the slots the graph reads differ from the ones it was traced on."""
    order = list(range(1, runner.max_total_num_tokens // runner.page_size + 1))
    random.Random(3).shuffle(order)
    slots = ManualSlots(runner, page_order=order)
    seqs = [slots.new_seq() for _ in prompts]
    logits = [runner.forward(slots.extend(seqs, prompts))]
    last = logits[0].argmax(-1).tolist()  # each request's next token
    for live in steps:
        logits.append(runner.forward(slots.decode(seqs[:live], last[:live])))
        last[:live] = logits[-1].argmax(-1).tolist()
    return logits


@needs_kernels  # CPU graphs: the cpu attention backend
@pytest.mark.parametrize("case", CASES)
def test_traced_decode_equals_the_eager_decode(case, checkpoint):
    arch, overrides, args = CASES[case]
    path = checkpoint(arch, overrides)
    graphed = make_runner(path, max_total_tokens=1024, **args)
    eager = make_runner(path, max_total_tokens=1024, disable_cuda_graph=True, **args)
    assert isinstance(graphed.graph_runner, CpuGraphRunner) and eager.graph_runner is None
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (13, 2, 21, 6, 9)]
    # 5 requests (bucket 8), 3 (bucket 4), then 1: every bucket sees several steps, each with
    # new lengths, positions and slots
    steps = [5, 5, 5, 3, 3, 3, 1, 1, 5]
    ours, theirs = _decode_run(graphed, prompts, steps), _decode_run(eager, prompts, steps)
    assert sorted(graphed.graph_runner.traced) == [1, 4, 8]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"


@needs_kernels
def test_batches_beyond_the_largest_bucket_and_prefills_run_eagerly(llama_path):
    runner = make_runner(llama_path, max_total_tokens=1024, cuda_graph_max_bs=2)
    graphs = runner.graph_runner
    assert graphs.batch_sizes == [1, 2]
    prompts = [[5, 6, 7], [8], [9, 10]]
    _decode_run(runner, prompts, [3, 2])
    assert sorted(graphs.traced) == [2]  # the batch of 3 and the prefill ran eagerly


@pytest.mark.parametrize("arch, args, reason", [
    ("llama", {"attention_backend": "torch_native"}, "decides per batch in Python"),
    ("llama", {"disable_cuda_graph": True}, None),
    # (without the cpu backend the first reason is the torch_native one)
    pytest.param("qwen3_moe", {}, "group the tokens by expert", marks=needs_kernels),
])
def test_graphs_only_where_a_trace_is_right(arch, args, reason, checkpoint, caplog):
    caplog.set_level("INFO", logger="radixserve.model_executor.model_runner")
    runner = make_runner(checkpoint(arch, {}), **args)
    assert runner.graph_runner is None and runner.cpu_graph_batch_sizes is None
    if reason is not None:
        assert "CPU graphs off: " in caplog.text and reason in caplog.text


@needs_kernels
def test_new_weights_drop_the_traced_graphs(llama_path):
    runner = make_runner(llama_path, max_total_tokens=1024)
    _decode_run(runner, [[5, 6, 7]], [1, 1])
    before = runner.graph_runner
    assert sorted(before.traced) == [1]
    runner.update_weights_from_disk(str(llama_path), None)
    assert isinstance(runner.graph_runner, CpuGraphRunner) and runner.graph_runner is not before
    assert not runner.graph_runner.traced
    runner.release_memory({"kv_cache"})
    assert runner.graph_runner is None
    runner.resume_memory({"kv_cache"})
    assert isinstance(runner.graph_runner, CpuGraphRunner)
