"""Token embedding and the output projection that may share its weight.

Both are replicated on every rank (not vocab-parallel): only ``tp_size == 1`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_kernels import BlockedWeight
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
        self.blocked: BlockedWeight | None = None  # the small-batch kernels' copy

    def prepack(self, blocked: bool = False) -> None:
        """Make the oneDNN copy ``project`` uses (bf16 on CPU; costs one more vocab x hidden),
        and with ``blocked`` the small-batch kernels' copy where they run (one more again)."""
        weight = self.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        if blocked:
            self.blocked = BlockedWeight.of(weight)

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T`` in the weight's dtype."""
        if self.blocked is not None and hidden_states.shape[0] <= self.blocked.max_rows:
            return self.blocked.linear(hidden_states, None)
        if self.packed_weight is not None:
            return mkldnn_linear(hidden_states, self.packed_weight, None)
        return torch.matmul(hidden_states, self.weight.T)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (``tie_word_embeddings``)."""
        self.weight = embedding.weight
