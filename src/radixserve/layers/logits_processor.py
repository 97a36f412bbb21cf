"""Hidden states → next-token logits of the last position of each request.

Only the rows that are sampled go through ``lm_head``: for an EXTEND batch the last new token of
each request (the others are prompt tokens whose logits nobody reads, unless the batch asks for
input logprobs: then their positions' rows follow, see ``forward_batch.py``), for DECODE every
row.

The logits stay in the model's dtype: the sampler upcasts them only when it needs more than an
argmax (a float32 copy of ``[64, 151936]`` costs more than the argmax itself).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.vocab_embedding import LMHead


class LogitsProcessor(nn.Module):
    def forward(
        self, hidden_states: torch.Tensor, lm_head: LMHead, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``hidden_states``: ``[num_tokens, hidden]`` → ``[batch_size (+ input logprob rows),
        vocab]``."""
        if forward_batch.forward_mode.is_extend:
            assert forward_batch.extend_seq_lens_cpu is not None
            ends = list(itertools.accumulate(forward_batch.extend_seq_lens_cpu))
            rows = [end - 1 for end in ends]
            if forward_batch.input_logprob_counts is not None:
                assert forward_batch.input_logprob_starts is not None
                for begin, start, count in zip(
                    [0, *ends[:-1]],
                    forward_batch.input_logprob_starts,
                    forward_batch.input_logprob_counts,
                    strict=True,
                ):
                    rows.extend(range(begin + start, begin + start + count))
            index = torch.tensor(rows, dtype=torch.int64, device=hidden_states.device)
            hidden_states = hidden_states[index]
        return lm_head.project(hidden_states)
