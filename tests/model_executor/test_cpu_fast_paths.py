"""bfloat16 on CPU runs the linear layers on oneDNN-prepacked weights: the products must match
the plain weights' to bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.linear import QKVParallelLinear, mkldnn_prepack_supported

pytestmark = pytest.mark.skipif(
    not mkldnn_prepack_supported(torch.device("cpu"), torch.bfloat16),
    reason="this torch build has no oneDNN",
)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_prepacked_linear_matches_plain_linear_in_bfloat16(num_tokens):
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, total_num_heads=4, total_num_kv_heads=2, bias=True)
    layer = layer.to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.prepack()
    assert layer.prepacked
    torch.testing.assert_close(layer(x), expected)  # bfloat16 tolerances


def test_bfloat16_runner_prepacks_its_linear_layers(llama_path):
    from tests.model_executor.harness import make_runner

    runner = make_runner(llama_path, dtype="bfloat16")
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.prepacked and layer.mlp.down_proj.prepacked
    assert runner.model.lm_head.packed_weight is not None
    fp32_runner = make_runner(llama_path, dtype="float32")
    assert not fp32_runner.model.model.layers[0].mlp.down_proj.prepacked
