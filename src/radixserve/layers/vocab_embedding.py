"""Token embedding and the output projection that may share its weight.

Both are replicated on every rank (not vocab-parallel): only ``tp_size == 1`` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import select_impl
from radixserve.layers.linear import default_weight_loader
from radixserve.layers.packed_weight import (
    NotPacked,
    PackedWeight,
    PackOptions,
    Prepackable,
    pack_float_weight,
)

if TYPE_CHECKING:
    from radixserve.layers.quantization import QuantizationConfig


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
    """``[vocab, hidden]`` output projection; ``LogitsProcessor`` applies it (no forward).

    Its ``weight`` stays the plain float parameter, which a tied model shares with the
    embedding; its ``PackedWeight`` is that weight's kernels' copy, or an int8 quantisation of
    it when the model's quantisation covers the LM head (the embedding keeps the float copy).
    """

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES

    def __init__(
        self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.impl = select_impl(self.cpu_dtypes)
        self.weight = _vocab_weight(vocab_size, hidden_size)
        self.quantized = quant_config is not None and quant_config.quantizes_lm_head()
        self.packed: PackedWeight = NotPacked()

    def prepack(self, options: PackOptions) -> PackedWeight:
        if self.quantized:
            from radixserve.layers.quantization.int8 import pack_int8, quantize_int8

            self.packed = pack_int8(*quantize_int8(self.weight), self.impl)
        else:
            self.packed = pack_float_weight(self.weight.detach(), self.impl, options)
        return self.packed

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T`` in the weight's dtype."""
        return self.packed.linear(hidden_states, None)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (``tie_word_embeddings``)."""
        self.weight = embedding.weight
