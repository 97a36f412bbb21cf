"""The CUDA-graph runner's device-independent part on CPU: batch-size buckets, static buffers,
padding a batch to the next captured size, and replay (here the "graph" runs the forward on the
static buffers). Padded decode steps give transformers' logits and greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.forward_batch import ForwardMode
from radixserve.model_executor.cuda_graph_runner import (
    PAD_OUT_CACHE_LOC,
    PAD_REQ_POOL_INDEX,
    PAD_SEQ_LEN,
    CudaGraphRunner,
    capture_batch_sizes,
    graph_memory_bytes,
)
from radixserve.server_args import ServerArgs
from tests.model_executor.harness import ManualSlots, hf_logits, make_runner


def test_capture_batch_sizes_follow_sglangs_buckets():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert capture_batch_sizes(50) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 50]
    with pytest.raises(ValueError, match="at least 1"):
        capture_batch_sizes(0)
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(model_path="m", cuda_graph_max_bs=0)


def test_cuda_graphs_are_cuda_only(llama_path):
    runner = make_runner(llama_path)
    assert runner.cuda_graph_batch_sizes is None  # CPU graphs instead (test_cpu_graph_runner.py)
    # CPU graphs where the cpu attention backend runs, no graphs at all elsewhere
    assert runner.graph_runner is None or not runner.graph_runner.use_cuda_graph
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(runner._decode_forward, torch.device("cpu"), [1], use_cuda_graph=True)


def test_padded_replay_matches_transformers(llama_path, hf_model):
    runner = make_runner(llama_path, page_size=4, max_total_tokens=1024)
    order = list(range(1, runner.max_total_num_tokens // 4 + 1))
    random.Random(1).shuffle(order)
    slots = ManualSlots(runner, page_order=order)
    graphs = CudaGraphRunner(runner._decode_forward, runner.device, [1, 2, 4, 8],
                             use_cuda_graph=False)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    assert graphs.padded_batch_size(3) == 4 and graphs.padded_batch_size(5) == 8

    rng = random.Random(2)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (9, 2, 15, 6, 4)]
    seqs = [slots.new_seq() for _ in prompts]
    first = runner.forward(slots.extend(seqs, prompts))
    step_logits = [first]
    for step in range(4):
        # 5 requests (padded to 8), then 3 of them (padded to 4); each replay equals the eager
        # forward of the same step.
        live = seqs if step < 2 else seqs[:3]
        next_tokens = step_logits[-1][: len(live)].argmax(-1).tolist()
        fb = slots.decode(live, next_tokens)
        assert graphs.can_run(fb)
        logits = graphs.replay(fb)
        padded = graphs.padded_batch_size(len(live))
        bs = len(live)
        assert logits.shape == (bs, runner.vocab_size)
        assert graphs.graphs[padded].batch.seq_lens_cpu == fb.seq_lens_cpu + [PAD_SEQ_LEN] * (
            padded - bs)
        assert torch.equal(graphs.input_ids[:bs], fb.input_ids)
        assert torch.equal(graphs.out_cache_loc[:bs], fb.out_cache_loc)
        assert (graphs.req_pool_indices[bs:padded] == PAD_REQ_POOL_INDEX).all()
        assert (graphs.seq_lens[bs:padded] == PAD_SEQ_LEN).all()
        assert (graphs.out_cache_loc[bs:padded] == PAD_OUT_CACHE_LOC).all()
        assert (graphs.input_ids[bs:padded] == 0).all()
        eager = runner.forward(fb)  # rewrites the same KV slots with the same values
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=0)
        step_logits.append(logits)

    hf = hf_model(llama_path)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        steps = [lg[i] for lg in step_logits if lg.shape[0] > i]
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(steps[: ref.shape[0]]), ref, atol=1e-4, rtol=0)
        assert seq.tokens[len(prompt):] == ref.argmax(-1).tolist()[: len(steps) - 1]


def test_extend_and_oversized_batches_run_eagerly(llama_path):
    runner = make_runner(llama_path)
    graphs = CudaGraphRunner(runner._decode_forward, runner.device, [1, 2], use_cuda_graph=False)
    graphs.capture()
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in range(3)]
    fb = slots.extend(seqs, [[5, 6], [7], [8, 9, 10]])
    assert fb.forward_mode is ForwardMode.EXTEND and not graphs.can_run(fb)
    runner.forward(fb)
    assert not graphs.can_run(slots.decode(seqs, [11, 12, 13]))  # 3 > the largest size, 2


def test_runner_replays_decode_and_recaptures_after_memory_and_weight_changes(llama_path):
    """The ModelRunner's wiring, with the CPU's eager stand-in for graphs: decode batches that
    fit go through the graph runner, the rest eagerly; releasing memory drops the graphs and
    resuming or new weights capture them again (the real graphs hold the old addresses)."""
    runner = make_runner(llama_path, max_total_tokens=1024)
    runner.cuda_graph_batch_sizes = [1, 2, 4]
    runner._capture_graphs()
    graphs = runner.graph_runner
    assert graphs is not None and not graphs.use_cuda_graph
    replays = []
    replay = graphs.replay
    graphs.replay = lambda fb: replays.append(fb.batch_size) or replay(fb)
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in range(3)]
    logits = runner.forward(slots.extend(seqs, [[5, 6, 7], [8], [9, 10]]))
    fb = slots.decode(seqs, logits.argmax(-1).tolist())
    graphed = runner.forward(fb)
    assert replays == [3]
    runner.graph_runner = None
    torch.testing.assert_close(graphed, runner.forward(fb), atol=1e-5, rtol=0)
    runner.graph_runner = graphs

    runner.release_memory({"kv_cache"})
    assert runner.graph_runner is None
    runner.resume_memory({"kv_cache"})
    assert runner.graph_runner is not None and runner.graph_runner is not graphs
    before = runner.graph_runner
    runner.update_weights_from_disk(str(llama_path), None)
    assert runner.graph_runner is not None and runner.graph_runner is not before


def test_graph_memory_comes_out_of_the_kv_budget(llama_path, monkeypatch):
    """Where graphs are planned, the KV pool is sized after taking their expected memory out of
    the budget: the pool shrinks by that many bytes' worth of tokens (the free memory is fixed
    here so that both runners plan against the same figure)."""
    from radixserve.model_executor import model_runner as runner_module

    monkeypatch.setattr(runner_module, "available_memory_bytes", lambda device: 1 << 30)
    plain = make_runner(llama_path, max_total_tokens=None, mem_fraction_static=0.5)
    assert plain.graph_reserved_bytes == 0
    monkeypatch.setattr(
        runner_module.ModelRunner, "_cuda_graph_batch_sizes", lambda self, settings, bs: [1, 2, 4]
    )
    graphed = make_runner(llama_path, max_total_tokens=None, mem_fraction_static=0.5)
    cfg = graphed.model_config
    reserved = graph_memory_bytes(
        [1, 2, 4], cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
        cfg.num_attention_heads, graphed.num_kv_heads, cfg.head_dim, graphed.dtype,
    )
    assert graphed.graph_reserved_bytes == reserved
    per_token = graphed.token_to_kv_pool.bytes_per_token(
        graphed.num_kv_heads, cfg.head_dim, graphed.num_layers, graphed.dtype
    )
    fewer = plain.max_total_num_tokens - graphed.max_total_num_tokens
    assert abs(fewer - reserved / per_token) <= graphed.page_size + 1


def test_graph_memory_estimate_grows_with_the_largest_batch_and_the_vocabulary():
    shape = {"hidden_size": 896, "intermediate_size": 4864, "num_heads": 14,
             "num_kv_heads": 2, "head_dim": 64, "dtype": torch.bfloat16}
    small = graph_memory_bytes([1, 2, 4], vocab_size=151936, **shape)
    assert graph_memory_bytes([1, 2, 4, 64], vocab_size=151936, **shape) > 10 * small // 2
    assert graph_memory_bytes([1, 2, 4], vocab_size=32000, **shape) < small
    # every captured size keeps its own logits (bf16) in the graphs' pool
    assert small > (1 + 2 + 4) * 151936 * 2
