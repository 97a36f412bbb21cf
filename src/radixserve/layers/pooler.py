"""Hidden states of an EXTEND batch → one embedding per request.

The tokens of all requests are concatenated in batch order (``ForwardBatch``), so request ``i``
owns rows ``[start_i, start_i + extend_seq_lens[i])``. Two poolings:

- ``LAST``: the hidden state of each request's last token (decoder embedders such as gte-Qwen:
  with causal attention only the last token has seen the whole input);
- ``MEAN``: the average over each request's tokens (sentence-transformers' BERT models).

Embeddings are returned in float32, L2-normalised when ``normalize`` is set, so that a dot
product is a cosine similarity.
"""

from __future__ import annotations

import enum
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.forward_batch import ForwardBatch


class PoolingType(enum.Enum):
    LAST = "last"
    MEAN = "mean"


class Pooler(nn.Module):
    def __init__(self, pooling_type: PoolingType, normalize: bool) -> None:
        super().__init__()
        self.pooling_type = pooling_type
        self.normalize = normalize

    def forward(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """``hidden_states``: ``[num_tokens, hidden]`` → ``[batch_size, hidden]`` float32."""
        assert forward_batch.extend_seq_lens_cpu is not None, "pooling needs an EXTEND batch"
        lens = forward_batch.extend_seq_lens_cpu
        device = hidden_states.device
        hidden = hidden_states.float()
        if self.pooling_type is PoolingType.LAST:
            last = torch.tensor(list(itertools.accumulate(lens)), device=device) - 1
            pooled = hidden[last]
        else:
            owner = torch.arange(len(lens), device=device).repeat_interleave(
                torch.tensor(lens, device=device)
            )
            sums = torch.zeros(len(lens), hidden.shape[1], device=device).index_add_(
                0, owner, hidden
            )
            pooled = sums / torch.tensor(lens, device=device, dtype=torch.float32)[:, None]
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled
