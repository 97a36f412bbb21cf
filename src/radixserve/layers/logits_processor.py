"""Hidden states → next-token logits of the last position of each request.

Only the rows that are sampled go through ``lm_head``: for an EXTEND batch the last new token of
each request (the others are prompt tokens whose logits nobody reads), for DECODE every row.
The logits stay in the model's dtype: the sampler upcasts them only when it needs more than an
argmax (a float32 copy of ``[64, 151936]`` costs more than the argmax itself).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from radixserve.layers.vocab_embedding import LMHead
from radixserve.model_executor.forward_batch import ForwardBatch


class LogitsProcessor(nn.Module):
    def forward(
        self, hidden_states: torch.Tensor, lm_head: LMHead, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``hidden_states``: ``[num_tokens, hidden]`` → ``[batch_size, vocab]``."""
        if forward_batch.forward_mode.is_extend:
            assert forward_batch.extend_seq_lens_cpu is not None
            last = list(itertools.accumulate(forward_batch.extend_seq_lens_cpu))
            index = torch.tensor(last, dtype=torch.int64, device=hidden_states.device) - 1
            hidden_states = hidden_states[index]
        return lm_head.project(hidden_states)
