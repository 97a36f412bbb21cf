"""Linear layers multiply with the ``PackedWeight`` that ``prepack_model`` builds once after
loading: the plain weight kept as loaded, plus the layouts of this device's kernels. Every layer
type, at every batch size, returns what ``F.linear`` on the plain weight returns (to float32
rounding in float32, bf16 rounding in bf16); a model that was not packed says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers.cpu_kernels import linear
from radixserve.layers.custom_op import OpImpl, build_context
from radixserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.packed_weight import (
    CpuPackedWeight,
    NativeWeight,
    Prepackable,
    prepack_model,
)
from radixserve.layers.vocab_embedding import LMHead, VocabEmbedding
from tests.layers.helpers import HAS_AMX, bf16_close, linear_kernel_here, require_linear_kernel
from tests.model_executor.harness import make_runner

LAYERS = {
    "column": lambda: ColumnParallelLinear(96, 48, bias=True),
    "merged": lambda: MergedColumnParallelLinear(64, [80, 80]),
    "qkv": lambda: QKVParallelLinear(64, 16, 4, 2, bias=True),
    "row": lambda: RowParallelLinear(200, 48, bias=True),
    "lm_head": lambda: LMHead(1001, 64),  # a vocabulary off every block size
}
MEMORY = 1 << 40  # room for every copy


def build_loaded(name: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    with build_context("cpu", dtype):
        layer = LAYERS[name]()
    gen = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=gen).to(dtype)
    return layer


def apply(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.project(x) if isinstance(layer, LMHead) else layer(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", LAYERS)
def test_packed_layers_equal_f_linear_on_the_plain_weight_at_every_batch_size(name, dtype):
    layer = build_loaded(name, dtype)
    with pytest.raises(RuntimeError, match="call prepack_model"):
        apply(layer, torch.zeros(1, layer.weight.shape[1], dtype=dtype))
    prepack_model(layer, MEMORY)
    assert layer.packed.weight.data_ptr() == layer.weight.data_ptr()  # the plain weight, kept
    assert isinstance(layer.packed, CpuPackedWeight if linear_kernel_here() else NativeWeight)
    gen = torch.Generator().manual_seed(1)
    bias = getattr(layer, "bias", None)
    for rows in (1, 2, 5, 16, 31, 32, 33, 64, 100):
        x = torch.randn(rows, layer.weight.shape[1], generator=gen).to(dtype)
        out = apply(layer, x)
        reference = F.linear(x, layer.weight, bias)
        assert out.shape == reference.shape and out.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
        else:
            bf16_close(out, x.double() @ layer.weight.double().T + (
                bias.double() if bias is not None else 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_weight_is_one_blocked_copy_for_every_batch_size(dtype):
    require_linear_kernel()
    layer = build_loaded("lm_head", dtype)  # 1001 rows: the copy pads them to 1008
    prepack_model(layer, MEMORY)
    packed = layer.packed
    assert packed.blocked.shape[0] * 16 == 1008 and packed.extra_bytes() == 1008 * 64 * (
        dtype.itemsize)
    x = torch.randn(70, 64).to(dtype)
    assert "amx" not in packed.candidates  # the AMX kernel takes whole blocks of 16 only
    packed.set_table(("blocked",) * len(packed.table))
    for rows in (1, 7, 70):
        assert torch.equal(layer.project(x[:rows]), linear(x[:rows], packed.blocked, None, 1001))


def test_without_room_for_a_copy_layers_keep_to_torch():
    layer = build_loaded("row", torch.bfloat16)
    prepack_model(layer, total_memory_bytes=1)
    assert isinstance(layer.packed, NativeWeight)
    x = torch.randn(3, 200).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_prepack_model_packs_every_linear_and_the_tied_lm_head_keeps_the_embedding():
    with build_context("cpu", torch.bfloat16):
        model = torch.nn.ModuleDict({
            "embed": VocabEmbedding(1001, 64),
            "lm_head": LMHead(1001, 64),
            "mlp": torch.nn.Sequential(MergedColumnParallelLinear(64, [32, 32]),
                                       RowParallelLinear(64, 64)),
        })
    model["lm_head"].tie_to(model["embed"])
    for p in model.parameters():
        p.data.normal_()
    prepack_model(model, MEMORY)
    packables = [m for m in model.modules() if isinstance(m, Prepackable)]
    assert len(packables) == 3
    assert all(m.packed.weight.data_ptr() == m.weight.data_ptr() for m in packables)
    assert model["lm_head"].packed.weight.data_ptr() == model["embed"].weight.data_ptr()
    expected = OpImpl.CPU if linear_kernel_here() else OpImpl.NATIVE
    assert all(m.impl is expected for m in packables)


def test_bf16_layers_on_amx_cpus_take_the_amx_kernel_up_to_32_rows():
    layer = build_loaded("qkv", torch.bfloat16)
    prepack_model(layer, MEMORY)  # the static table: AMX up to 32 rows, then oneDNN's AMX GEMM
    table = getattr(layer.packed, "table", ())
    if HAS_AMX:
        assert table == ("amx",) * 6 + ("onednn",) * 4
    else:
        assert "amx" not in table


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_runners_linears_carry_the_packed_weight_of_their_dtype(llama_path, dtype):
    runner = make_runner(llama_path, dtype=dtype)
    layer = runner.model.model.layers[0]
    kinds = {type(m.packed) for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj,
                                      runner.model.lm_head)}
    assert kinds == {CpuPackedWeight if linear_kernel_here() else NativeWeight}
