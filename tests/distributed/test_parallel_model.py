"""The model split over real gloo ranks computes the logits of the model in one process.

Two ranks, one thread each, run a prefill and a decode step of a mixed batch through the
``TpModelWorker``'s parts: tensor parallel (the vocabulary, tied embeddings, GQA with one KV head
per rank or a KV head replicated on both ranks) and pipeline parallel (activations sent from stage
to stage). The last rank's logits must match the single-process runner's in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.distributed import RankInfo, init_parallel_state
from radixserve.forward_batch import StageActivations
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_runner import ModelRunner, RunnerSettings
from radixserve.server_args import ServerArgs
from tests.checkpoints import build_checkpoint
from tests.distributed.helpers import run_ranks
from tests.model_executor.harness import ManualSlots, make_runner

PROMPTS = [[6, 7, 8, 9, 10], list(range(20, 53)), [300, 301]]


def _run_steps(runner: ModelRunner, forward) -> list[torch.Tensor]:
    """A prefill of ``PROMPTS`` and one decode step; each step's logits (None off the last
    stage). ``forward(batch)`` runs one step on this rank."""
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in PROMPTS]
    prefill = forward(slots.extend(seqs, PROMPTS))
    next_tokens = [500, 501, 502]  # fixed inputs: every rank must build the same batch
    decode = forward(slots.decode(seqs, next_tokens))
    return [prefill, decode]


def _rank_logits(rank: int, init_method: str, model_path: str, tp: int, pp: int):
    info = RankInfo.of_rank(rank, tp, pp)
    parallel = init_parallel_state(info, init_method, torch.device("cpu"), 120)
    args = ServerArgs(model_path=model_path, dtype="float32", device="cpu", max_total_tokens=512,
                      tp_size=tp, pp_size=pp)
    config = ModelConfig.from_path(model_path, dtype="float32", device="cpu")
    runner = ModelRunner(config, RunnerSettings.from_args(args), "cpu", parallel)
    hidden = config.hidden_size

    def forward(batch):
        previous = None
        if not info.is_first_stage:
            stacked = parallel.p2p.recv_tensor(
                (2, batch.num_tokens, hidden), torch.float32, torch.device("cpu"),
                info.stage_rank(info.pp_rank - 1),
            )
            previous = StageActivations(stacked[0], stacked[1])
        out = runner.forward(batch, previous)
        if isinstance(out, StageActivations):
            parallel.p2p.send_tensor(
                torch.stack([out.hidden_states, out.residual]), info.stage_rank(info.pp_rank + 1)
            )
            return None
        return out

    steps = _run_steps(runner, forward)
    torch.distributed.barrier()
    return {
        "kv_heads": runner.token_to_kv_pool.head_num,
        "kv_layers": runner.token_to_kv_pool.layer_num,
        "logits": [s.tolist() if s is not None else None for s in steps],
    }


@pytest.fixture(scope="module")
def one_kv_head_path(tmp_path_factory) -> Path:
    """Llama with a single KV head: two tensor-parallel ranks replicate it."""
    return build_checkpoint(tmp_path_factory.mktemp("kv1"), "llama", num_key_value_heads=1)


@pytest.mark.parametrize(
    ("checkpoint", "tp", "pp"),
    [("one_kv_head", 2, 1), ("qwen2", 2, 1), ("qwen3", 1, 2)],
    ids=["tp2-gqa-replicated-kv", "tp2-qwen2-tied-bias", "pp2-qwen3-tied-qk-norm"],
)
def test_split_model_matches_one_process(checkpoint, tp, pp, checkpoint_factory, request):
    path = (
        request.getfixturevalue("one_kv_head_path")
        if checkpoint == "one_kv_head"
        else checkpoint_factory(checkpoint)
    )
    single = make_runner(path, max_total_tokens=512)
    reference = _run_steps(single, single.forward)
    results = run_ranks(
        "tests.distributed.test_parallel_model:_rank_logits", tp * pp, str(path), tp, pp
    )
    config = single.model_config
    for rank, result in enumerate(results):
        info = RankInfo.of_rank(rank, tp, pp)
        assert result["kv_heads"] == max(1, config.num_key_value_heads // tp)
        assert result["kv_layers"] == config.num_hidden_layers // pp
        if not info.is_last_stage:
            assert result["logits"] == [None, None]
            continue
        for step, expected in zip(result["logits"], reference, strict=True):
            torch.testing.assert_close(torch.tensor(step), expected, atol=2e-5, rtol=1e-4)
