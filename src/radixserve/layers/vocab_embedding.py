"""Token embedding and the output projection that may share its weight.

Both are replicated on every rank (not vocab-parallel): only ``tp_size == 1`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import select_impl
from radixserve.layers.linear import default_weight_loader
from radixserve.layers.packed_weight import NotPacked, PackedWeight, Prepackable, pack_float_weight


def _vocab_weight(vocab_size: int, hidden_size: int) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
    weight.weight_loader = default_weight_loader
    return weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _vocab_weight(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(Prepackable):
    """``[vocab, hidden]`` output projection; ``LogitsProcessor`` applies it (no forward). Its
    ``PackedWeight`` keeps the plain weight, which a tied model shares with the embedding."""

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.impl = select_impl(self.cpu_dtypes)
        self.weight = _vocab_weight(vocab_size, hidden_size)
        self.packed: PackedWeight = NotPacked()

    def prepack(self, room_for_copy: bool) -> PackedWeight:
        self.packed = pack_float_weight(self.weight.detach(), self.impl, room_for_copy)
        return self.packed

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T`` in the weight's dtype."""
        return self.packed.linear(hidden_states, None)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (``tie_word_embeddings``)."""
        self.weight = embedding.weight
