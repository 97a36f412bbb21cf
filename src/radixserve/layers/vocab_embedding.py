"""Token embedding and the output projection that may share its weight, split over the vocabulary.

With tensor parallelism each rank holds a contiguous shard of the vocabulary's rows (the
vocabulary is padded to a multiple of ``tp_size``; padding rows are zero and their logits are cut
off). The embedding looks up the ids of its shard, zeroes the others and sums over the group; the
LM head computes its shard's logits and gathers them. With ``tp_size == 1`` both are the plain
layers, unpadded.
"""

from __future__ import annotations

from typing import Unpack

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import RankGroup
from radixserve.layers.linear import LayerOptions, layer_options
from radixserve.layers.linear_method import WeightSource, default_weight_loader
from radixserve.layers.packed_weight import (
    PackedWeight,
    PackOptions,
    Prepackable,
    pack_float_weight,
)


class VocabShard:
    """Rows ``[start, start + size)`` of the padded vocabulary belong to this rank."""

    def __init__(self, vocab_size: int, tp: RankGroup) -> None:
        self.vocab_size = vocab_size
        self.size = -(-vocab_size // tp.size)
        self.start = tp.rank_in_group * self.size
        # rows of the checkpoint tensor that exist in this shard (the last may be short)
        self.loaded = max(0, min(self.size, vocab_size - self.start))

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource) -> None:
        if loaded_weight.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch: vocabulary of {self.vocab_size} vs checkpoint "
                f"{tuple(loaded_weight.shape)}"
            )
        param.data[self.loaded :].zero_()
        default_weight_loader(
            param.data.narrow(0, 0, self.loaded), loaded_weight.narrow(0, self.start, self.loaded)
        )


def _vocab_weight(shard: VocabShard, hidden_size: int) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(shard.size, hidden_size), requires_grad=False)
    weight.weight_loader = shard.weight_loader
    return weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: RankGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or RankGroup.single()
        self.shard = VocabShard(vocab_size, self.tp)
        self.weight = _vocab_weight(self.shard, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(Prepackable):
    """``[vocab, hidden]`` output projection; ``LogitsProcessor`` applies it (no forward).

    Its ``weight`` stays the plain float parameter, which a tied model shares with the
    embedding; its ``PackedWeight`` is that weight's kernels' copy, or an int8 quantisation of
    it when the model's quantisation covers the LM head (the embedding keeps the float copy).
    """

    def __init__(self, vocab_size: int, hidden_size: int, **options: Unpack[LayerOptions]) -> None:
        super().__init__()
        quant_config, self.tp = layer_options(options)
        self.shard = VocabShard(vocab_size, self.tp)
        self.weight = _vocab_weight(self.shard, hidden_size)
        # the quantisation that covers the LM head, if any
        self.quant_config = (
            quant_config if quant_config is not None and quant_config.quantizes_lm_head() else None
        )

    def pack(self, options: PackOptions) -> PackedWeight:
        if self.quant_config is not None:
            from radixserve.layers.quantization.int8 import pack_int8, quantize_int8

            group_size = self.quant_config.lm_head_group_size()
            return pack_int8(*quantize_int8(self.weight, group_size), self.impl)
        return pack_float_weight(self.weight.detach(), self.impl, options)

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T`` in the weight's dtype, ``[rows, vocab_size]``."""
        logits = self.packed.linear(hidden_states, None)
        if self.tp.size == 1:
            return logits
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.shard.vocab_size].contiguous()

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (``tie_word_embeddings``)."""
        self.weight = embedding.weight
