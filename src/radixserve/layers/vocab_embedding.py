"""Token embedding and the output projection that may share its weight.

Both are replicated on every rank (not vocab-parallel): only ``tp_size == 1`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_kernels import gemv, gemv_supported, pack_gemv_weight
from radixserve.layers.linear import default_weight_loader, mkldnn_linear


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


class LMHead(nn.Module):
    """``[vocab, hidden]`` output projection; ``LogitsProcessor`` applies it (no forward)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _vocab_weight(vocab_size, hidden_size)
        # oneDNN-reordered copy (see layers/linear.py); a copy because a tied weight is also
        # the embedding table, which needs the plain layout.
        self.packed_weight: torch.Tensor | None = None
        self.gemv_weight: torch.Tensor | None = None  # the batch-1 kernel's copy

    def prepack(self, gemv: bool = False) -> None:
        """Make the oneDNN copy ``project`` uses (bf16 on CPU; costs one more vocab x hidden),
        and with ``gemv`` the batch-1 kernel's copy where it runs (one more again)."""
        weight = self.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        if gemv and gemv_supported(weight):
            self.gemv_weight = pack_gemv_weight(weight)

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T`` in the weight's dtype."""
        if self.gemv_weight is not None and hidden_states.shape[0] == 1:
            return gemv(hidden_states, self.gemv_weight, None)
        if self.packed_weight is not None:
            return mkldnn_linear(hidden_states, self.packed_weight, None)
        return torch.matmul(hidden_states, self.weight.T)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (``tie_word_embeddings``)."""
        self.weight = embedding.weight
