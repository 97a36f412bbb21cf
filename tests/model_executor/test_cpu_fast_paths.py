"""A model built with radixserve's CPU kernels (ops, packed weights, the ``cpu`` attention
backend) computes what the same model built with every op's torch reference and the
``torch_native`` backend computes: the same float32 logits to rounding, bf16 logits within bf16
noise, over prefills with cached prefixes and decode steps."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import custom_op
from radixserve.layers.custom_op import OpImpl
from tests.checkpoints import build_checkpoint
from tests.layers.helpers import AVX2_OPS, require_kernels, require_ops
from tests.model_executor.harness import ManualSlots, make_runner

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}


def run_steps(path, dtype: str, attention_backend: str) -> torch.Tensor:
    runner = make_runner(path, dtype=dtype, attention_backend=attention_backend)
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in range(3)]
    steps = [runner.forward(slots.extend(seqs, [list(range(5, 45)), [8, 2, 77], [9] * 17]))]
    steps.append(runner.forward(slots.extend(seqs[:2], [[4, 5, 6], [7]])))  # cached prefixes
    for tokens in ([3, 11, 6], [12, 4, 30]):
        steps.append(runner.forward(slots.decode(seqs, tokens)))
    return torch.cat([s.float() for s in steps])


def native_runner_steps(path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:  # ops and weights built as if no kernel loaded
        m.setattr(custom_op, "has_ops", lambda *names: False)
        return run_steps(path, dtype, "torch_native")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_model_equals_the_native_model(arch_path, dtype, monkeypatch):
    require_kernels()
    runner = make_runner(arch_path, dtype=dtype)
    assert runner.attention_backend == "cpu"
    assert runner.model.model.layers[0].mlp.act_fn.impl is OpImpl.CPU
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        run_steps(arch_path, dtype, "cpu"), native_runner_steps(arch_path, dtype, monkeypatch),
        atol=tol, rtol=tol,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_ops_beside_torch_native_attention_equal_the_native_model(
    arch_path, dtype, monkeypatch
):
    """What an AVX2 CPU runs (the linear and elementwise kernels, the ``torch_native``
    attention backend), on AVX-512 CPUs too."""
    require_ops(*AVX2_OPS)
    runner = make_runner(arch_path, dtype=dtype, attention_backend="torch_native")
    layer = runner.model.model.layers[0]
    assert layer.mlp.act_fn.impl is layer.input_layernorm.impl is OpImpl.CPU
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        run_steps(arch_path, dtype, "torch_native"),
        native_runner_steps(arch_path, dtype, monkeypatch), atol=tol, rtol=tol,
    )


@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 14, 2), (128, 4, 4), (48, 8, 1)])
def test_cpu_attention_backend_on_other_head_shapes_equals_the_native_model(
    tmp_path, head_dim, heads, kv_heads, monkeypatch
):
    require_kernels()
    path = build_checkpoint(tmp_path / "llama", "llama", hidden_size=112,
                            num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim)
    torch.testing.assert_close(
        run_steps(path, "bfloat16", "cpu"), native_runner_steps(path, "bfloat16", monkeypatch),
        atol=0.05, rtol=0.05,
    )


def test_the_cpu_attention_backend_refuses_a_shape_its_kernels_cannot_take(tmp_path):
    require_kernels()
    path = build_checkpoint(tmp_path / "llama", "llama", head_dim=40)
    assert make_runner(path).attention_backend == "torch_native"  # the default falls back
    with pytest.raises(ValueError, match="head_dim that is a multiple of 16 up to 256, not 40"):
        make_runner(path, attention_backend="cpu")
