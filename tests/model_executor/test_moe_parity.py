"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers in float32 (4 to 16 experts, top-1,
top-2 and top-8, renormalised or not, Qwen2-MoE's gated shared expert and a dense layer among
sparse ones): batched prefill, an extend on a cached prefix and greedy decode; and the fused
MoE op's CPU path (experts as matmuls on their sorted token runs) against its reference."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.layers.custom_op import OpImpl, build_context
from radixserve.layers.fused_moe import FusedMoE
from tests.checkpoints import build_checkpoint
from tests.model_executor.harness import ManualSlots, hf_logits, make_runner

SHAPES = {
    "mixtral-4x-top2": ("mixtral", {}),
    "mixtral-8x-top1": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=1)),
    # shared expert, top-2 of 8 not renormalised; layer 1 dense
    "qwen2-moe": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1],
                                    layer_types=["full_attention"] * 3)),
    "qwen2-moe-4x-top1-norm": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=1,
                                                 norm_topk_prob=True)),
    "qwen3-moe-16x-top8": ("qwen3_moe", {}),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_moe_families_match_transformers(shape, tmp_path, hf_model):
    arch, overrides = SHAPES[shape]
    path = build_checkpoint(tmp_path / shape, arch, **overrides)
    runner = make_runner(path, page_size=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (19, 4, 11)]
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    runner.forward(slots.extend(seqs[:1], [prompts[0][:8]]))  # a cached prefix
    step_logits = [runner.forward(slots.extend(seqs, [prompts[0][8:], *prompts[1:]]))]
    for _ in range(8):
        step_logits.append(runner.forward(slots.decode(seqs, step_logits[-1].argmax(-1).tolist())))
    hf = hf_model(path)
    final = step_logits[-1].argmax(-1).tolist()
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        ours = torch.stack([logits[i] for logits in step_logits])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        assert seq.tokens[len(prompt) :] + [final[i]] == ref.argmax(-1).tolist()


@pytest.mark.parametrize("experts, top_k, renormalize, weights", [
    (4, 1, True, "float32"), (8, 2, False, "float32"), (16, 8, True, "float32"),
    (8, 2, False, "bfloat16"), (16, 8, True, "int8"),
])
def test_fused_moe_cpu_path_equals_the_reference(experts, top_k, renormalize, weights):
    """The grouped CPU path (one sort, one matmul per projection per active expert) against the
    per-expert reference on the same packed weights: fp32 to rounding, bf16 (on AMX CPUs the
    grouped AMX kernel) and int8 experts (bf16 activations) within bf16's tolerance; experts no
    token chose are skipped."""
    from radixserve.layers import cpu_kernels
    from radixserve.layers.packed_weight import prepack_model
    from radixserve.layers.quantization.int8 import Int8AtLoad

    torch.manual_seed(experts)
    dtype = torch.float32 if weights == "float32" else torch.bfloat16
    quant = Int8AtLoad() if weights == "int8" else None
    with build_context("cpu", dtype):
        moe = FusedMoE(experts, top_k, 64, 64, renormalize, quant)  # AMX takes K % 32 == 0
    if moe.impl is not OpImpl.CPU:
        pytest.skip("radixserve's CPU kernels do not run here")
    for p in moe.parameters():
        p.data.normal_(0.0, 0.2)
    prepack_model(moe, 1 << 34, False, "off")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x, logits = torch.randn(37, 64, dtype=dtype), torch.randn(37, experts)
    torch.testing.assert_close(moe.forward_cpu(x, logits), moe.forward_native(x, logits), **tol)
    if weights == "bfloat16" and cpu_kernels.amx_available():  # ~9 rows per expert: grouped
        assert moe._grouped_amx(x[:4], [1, 0, 3] + [0] * (experts - 3)) is not None
    # a token routed to no expert at all is impossible; an expert no token chose is skipped
    one = torch.full((5, experts), -10.0)
    one[:, 0] = 10.0
    torch.testing.assert_close(moe.forward_cpu(x[:5], one), moe.forward_native(x[:5], one),
                               **tol)
