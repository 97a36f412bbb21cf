"""``--ep-size``: MoE experts split over groups of the tensor-parallel ranks.

In one process (loading communicates nothing): each rank of tp=2/ep=2 and tp=4/ep=2 holds only
its expert group's experts, sliced over the group's ranks, and the ranks' outputs summed (what the
tensor-parallel all-reduce does) equal one process's, on the CPU path and the reference; the flags
are checked. On two real gloo ranks (one spawn): Mixtral top-1 (its checkpoint names renamed) and
Qwen2-MoE (shared expert, a dense layer) at tp=ep=2 give the one-process logits and greedy tokens
of a prefill and a decode step; a rank reads no tensor of the other rank's experts; a dense model
with ``ep_size=2`` is refused.
"""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve.distributed import RankGroup, RankInfo, init_parallel_state
from radixserve.layers.custom_op import OpImpl, build_context
from radixserve.layers.fused_moe import FusedMoE
from radixserve.layers.linear_method import load_into_parameter
from radixserve.layers.packed_weight import prepack_model
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_runner import ModelRunner, RunnerSettings
from radixserve.server_args import ServerArgs
from tests.checkpoints import build_checkpoint
from tests.distributed.helpers import run_ranks
from tests.distributed.test_parallel_model import _run_steps
from tests.model_executor.harness import make_runner

HIDDEN, INTER = 32, 24


class SummedLater(RankGroup):
    """One rank of a group simulated in this process: the test sums the ranks' outputs."""

    def all_reduce(self, tensor, op=None):
        return tensor


def _moe(experts: int, top_k: int, tp: RankGroup | None, ep_size: int,
         weights: dict[int, tuple[torch.Tensor, ...]]) -> FusedMoE:
    with build_context("cpu", torch.float32):
        moe = FusedMoE(experts, top_k, HIDDEN, INTER, True, tp=tp, ep_size=ep_size)
    for e in moe.expert_range:
        gate, up, down = weights[e]
        expert = moe._modules[str(e)]
        load_into_parameter(expert.gate_up_proj.weight, gate, 0)
        load_into_parameter(expert.gate_up_proj.weight, up, 1)
        load_into_parameter(expert.down_proj.weight, down)
    prepack_model(moe, 1 << 34, False, "off")
    return moe


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2), (4, 4)])
def test_ranks_hold_their_experts_and_sum_to_one_process(tp, ep):
    experts, top_k = 8, 2
    torch.manual_seed(tp * 10 + ep)
    weights = {e: (torch.randn(INTER, HIDDEN) * 0.2, torch.randn(INTER, HIDDEN) * 0.2,
                   torch.randn(HIDDEN, INTER) * 0.2) for e in range(experts)}
    single = _moe(experts, top_k, None, 1, weights)
    x, logits = torch.randn(13, HIDDEN), torch.randn(13, experts)
    logits[:, :4] -= 100.0  # every token chooses from experts 4..7: group 0 gets no pair at all
    expected = single.forward_native(x, logits)
    cpu_sum = native_sum = torch.zeros_like(x)
    per_group = experts // ep
    for rank in range(tp):
        moe = _moe(experts, top_k, SummedLater(list(range(tp)), rank), ep, weights)
        group = rank // (tp // ep)
        assert moe.expert_range == range(group * per_group, (group + 1) * per_group)
        assert sorted(int(name) for name in moe._modules) == list(moe.expert_range)
        gate_up = moe._modules[str(moe.first_expert)].gate_up_proj
        assert gate_up.tp_size == tp // ep  # an expert sliced over its group's ranks only
        # forward_cpu calls the kernels' silu_and_mul: where they do not run (an AVX2 build has
        # only the linear kernel) the bound implementation is the native one
        cpu = moe.forward_cpu if moe.impl is OpImpl.CPU else moe.forward
        cpu_sum = cpu_sum + cpu(x, logits)
        native_sum = native_sum + moe.forward_native(x, logits)
    torch.testing.assert_close(cpu_sum, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native_sum, expected, atol=1e-5, rtol=1e-5)


def test_ep_size_must_divide_tp_size_and_the_experts(tmp_path):
    with pytest.raises(ValueError, match=r"ep_size \(4\) must divide tp_size \(2\)"):
        ServerArgs(model_path=str(tmp_path), tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="ep_size must be >= 1"):
        ServerArgs(model_path=str(tmp_path), ep_size=0)
    with pytest.raises(ValueError, match="ep_size 2 must divide the model's 3 experts"):
        FusedMoE(3, 1, HIDDEN, INTER, True, tp=RankGroup([0, 1], 0), ep_size=2)


CHECKPOINTS = {
    "mixtral-top1": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=1)),
    "qwen2_moe-shared-dense": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1],
                                                 layer_types=["full_attention"] * 3)),
}


class _Ignored(logging.Handler):
    """Records the loader's warning about checkpoint tensors no parameter took."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ep_rank(rank: int, init_method: str, paths: dict[str, str], dense_path: str) -> dict:
    """One of two tp=ep=2 ranks: per checkpoint, its experts and both steps' logits."""
    info = RankInfo.of_rank(rank, 2, 1)
    parallel = init_parallel_state(info, init_method, torch.device("cpu"), 120)
    ignored = _Ignored()
    logging.getLogger("radixserve.model_executor.model_loader").addHandler(ignored)
    out: dict = {}
    for name, path in paths.items():
        args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=512,
                          tp_size=2, ep_size=2)
        config = ModelConfig.from_path(path, dtype="float32", device="cpu")
        runner = ModelRunner(config, RunnerSettings.from_args(args), "cpu", parallel)
        moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
        steps = _run_steps(runner, runner.forward)
        out[name] = {
            "experts": [list(m.expert_range) for m in moe],
            "built": sorted({int(n) for m in moe for n in m._modules}),
            "logits": [s.tolist() for s in steps],
        }
    args = ServerArgs(model_path=dense_path, dtype="float32", device="cpu",
                      max_total_tokens=512, tp_size=2, ep_size=2)
    config = ModelConfig.from_path(dense_path, dtype="float32", device="cpu")
    try:
        ModelRunner(config, RunnerSettings.from_args(args), "cpu", parallel)
        out["dense"] = None
    except ValueError as e:
        out["dense"] = str(e)
    out["ignored"] = ignored.messages
    torch.distributed.barrier()
    return out


def test_expert_parallel_models_match_one_process(tmp_path, checkpoint_factory):
    paths = {name: build_checkpoint(tmp_path / name, arch, **overrides)
             for name, (arch, overrides) in CHECKPOINTS.items()}
    results = run_ranks("tests.distributed.test_expert_parallel:_ep_rank", 2,
                        {name: str(p) for name, p in paths.items()},
                        str(checkpoint_factory("llama")))
    for result in results:
        assert result["ignored"] == []  # the other rank's experts were skipped, not ignored
        assert "has none" in result["dense"] and "--ep-size 2" in result["dense"]
    for name, path in paths.items():
        single = make_runner(path, max_total_tokens=512)
        reference = _run_steps(single, single.forward)
        experts = next(m for m in single.model.modules() if isinstance(m, FusedMoE)).num_experts
        half = experts // 2
        for rank, result in enumerate(results):
            ours = result[name]
            own = list(range(rank * half, (rank + 1) * half))
            assert ours["built"] == own and all(e == own for e in ours["experts"])
            for step, expected in zip(ours["logits"], reference, strict=True):
                torch.testing.assert_close(torch.tensor(step), expected, atol=2e-5, rtol=1e-4)
                assert torch.tensor(step).argmax(-1).tolist() == expected.argmax(-1).tolist()
