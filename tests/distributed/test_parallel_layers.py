"""Each tensor-parallel rank's linear, QKV, vocabulary and LM-head shards, loaded lazily.

Loading communicates nothing, so every rank's layers are built in this one process with a
``RankGroup`` that names the rank (the forward passes, which all-reduce and gather, run in real
ranks in ``test_parallel_model.py``).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from radixserve.distributed import RankGroup
from radixserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.vocab_embedding import LMHead, VocabEmbedding
from radixserve.model_executor.model_loader import SafetensorsSlice


class RecordingWeight:
    """A lazy checkpoint tensor that records how many elements each ``load`` reads."""

    def __init__(self, tensor: torch.Tensor, loads: list[int]) -> None:
        self.tensor, self.loads = tensor, loads

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> RecordingWeight:
        return RecordingWeight(self.tensor.narrow(dim, start, length), self.loads)

    def load(self) -> torch.Tensor:
        self.loads.append(self.tensor.numel())
        return self.tensor.clone()


def ranks(tp: int) -> list[RankGroup]:
    return [RankGroup(list(range(tp)), r) for r in range(tp)]


def load(layer, param_name: str, full: torch.Tensor, *shard: object) -> list[int]:
    """Load ``full`` into the layer's parameter lazily; the element counts it read."""
    loads: list[int] = []
    param = getattr(layer, param_name)
    param.weight_loader(param, RecordingWeight(full, loads), *shard)
    return loads


def test_column_parallel_rank_holds_its_rows_and_reads_only_them():
    full_w, full_b = torch.randn(6, 8), torch.randn(6)
    for r, tp in enumerate(ranks(2)):
        layer = ColumnParallelLinear(8, 6, bias=True, tp=tp)
        assert load(layer, "weight", full_w) == [3 * 8]
        assert load(layer, "bias", full_b) == [3]
        assert torch.equal(layer.weight, full_w[3 * r : 3 * r + 3])
        assert torch.equal(layer.bias, full_b[3 * r : 3 * r + 3])


def test_merged_gate_up_rank_holds_its_slice_of_each_part():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    for r, tp in enumerate(ranks(2)):
        layer = MergedColumnParallelLinear(4, [6, 6], tp=tp)
        assert load(layer, "weight", gate, 0) == [12]
        assert load(layer, "weight", up, 1) == [12]
        expected = torch.cat([gate[3 * r : 3 * r + 3], up[3 * r : 3 * r + 3]])
        assert torch.equal(layer.weight, expected)


def test_row_parallel_rank_holds_its_columns_and_the_whole_bias():
    full_w, full_b = torch.randn(5, 8), torch.randn(5)
    for r, tp in enumerate(ranks(2)):
        layer = RowParallelLinear(8, 5, bias=True, tp=tp)
        assert load(layer, "weight", full_w) == [5 * 4]
        load(layer, "bias", full_b)
        assert torch.equal(layer.weight, full_w[:, 4 * r : 4 * r + 4])
        assert torch.equal(layer.bias, full_b)


def _qkv(heads: int, kv_heads: int, head_dim: int = 2, hidden: int = 4):
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    return q, k, v


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 4, 2)])
def test_qkv_rank_holds_its_query_heads_then_its_kv_heads(heads, kv_heads, tp):
    q, k, v = _qkv(heads, kv_heads)
    for r, group in enumerate(ranks(tp)):
        layer = QKVParallelLinear(4, 2, heads, kv_heads, tp=group)
        for name, part in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", part, name)
        qs, kvs = layer.q_size, layer.kv_size
        assert layer.kv_replicas == 1
        assert torch.equal(layer.weight[:qs], q[r * qs : (r + 1) * qs])
        assert torch.equal(layer.weight[qs : qs + kvs], k[r * kvs : (r + 1) * kvs])
        assert torch.equal(layer.weight[qs + kvs :], v[r * kvs : (r + 1) * kvs])


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 1, 2), (8, 2, 4), (4, 2, 4)])
def test_fewer_kv_heads_than_ranks_replicate_the_head_the_ranks_queries_use(heads, kv_heads, tp):
    """Rank r's query heads are [r*h, (r+1)*h); in GQA they read KV head (query head) //
    (heads / kv_heads), which is r // (tp / kv_heads): the head rank r must hold."""
    q, k, v = _qkv(heads, kv_heads)
    head_dim = 2
    for r, group in enumerate(ranks(tp)):
        layer = QKVParallelLinear(4, head_dim, heads, kv_heads, tp=group)
        assert layer.num_kv_heads == 1 and layer.kv_replicas == tp // kv_heads
        assert load(layer, "weight", k, "k") == [head_dim * 4]  # one head read, not all
        load(layer, "weight", v, "v")
        load(layer, "weight", q, "q")
        first_query_head = r * (heads // tp)
        kv_head = first_query_head // (heads // kv_heads)
        assert kv_head == r // (tp // kv_heads)
        qs = layer.q_size
        expected_k = k[kv_head * head_dim : (kv_head + 1) * head_dim]
        assert torch.equal(layer.weight[qs : qs + head_dim], expected_k)


def test_vocabulary_shards_pad_the_last_rank_with_zero_rows():
    vocab, hidden = 1001, 8
    full = torch.randn(vocab, hidden)
    for r, tp in enumerate(ranks(2)):
        embed = VocabEmbedding(vocab, hidden, tp)
        head = LMHead(vocab, hidden, tp=tp)
        assert embed.weight.shape == head.weight.shape == (501, hidden)
        assert load(embed, "weight", full) == [(501 if r == 0 else 500) * hidden]
        load(head, "weight", full)
        rows = full[501 * r : 501 * (r + 1)]
        assert torch.equal(embed.weight[: len(rows)], rows)
        assert torch.equal(head.weight[: len(rows)], rows)
        assert not embed.weight[len(rows) :].any()


def test_layers_refuse_splits_that_do_not_divide():
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        QKVParallelLinear(4, 2, 3, 1, tp=ranks(2)[0])
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        QKVParallelLinear(4, 2, 6, 3, tp=ranks(2)[0])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(4, 2, 12, 3, tp=ranks(4)[0])
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        RowParallelLinear(7, 4, tp=ranks(2)[0])


def test_safetensors_slice_reads_only_the_narrowed_part(tmp_path):
    full = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    path = tmp_path / "w.safetensors"
    save_file({"w": full}, path)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        lazy = SafetensorsSlice(f, "w")
        assert lazy.shape == (6, 10)
        part = lazy.narrow(0, 2, 3).narrow(1, 4, 5)
        assert part.shape == (3, 5)
        assert torch.equal(part.load(), full[2:5, 4:9])
        assert torch.equal(part.narrow(0, 1, 1).load(), full[3:4, 4:9])
        with pytest.raises(ValueError, match="out of range"):
            part.narrow(1, 2, 4)
