"""Drive a ModelRunner by hand: ForwardBatches whose KV slots are handed out page by page from a
fixed page order (standing in for the allocator), with the scheduler's bookkeeping reduced to one
``SeqState`` per request; plus the transformers reference logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_runner import ModelRunner, RunnerSettings
from radixserve.server_args import ServerArgs


@dataclass
class SeqState:
    row: int  # req_to_token row
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache
    pages: list[int] = field(default_factory=list)


class ManualSlots:
    """Writes ``req_to_token`` rows and hands out KV slots; pages are taken in ``page_order``
    (default: ascending from page 1, after the reserved padding page)."""

    def __init__(self, runner: ModelRunner, page_order: list[int] | None = None) -> None:
        self.runner = runner
        self.page_size = runner.page_size
        num_pages = runner.max_total_num_tokens // self.page_size
        self.free_pages = list(page_order or range(1, num_pages + 1))

    def new_seq(self) -> SeqState:
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None
        return SeqState(row)

    def _slots(self, seq: SeqState, n: int) -> torch.Tensor:
        start = len(seq.tokens)
        slots = []
        for pos in range(start, start + n):
            if pos % self.page_size == 0:
                seq.pages.append(self.free_pages.pop(0))
            slots.append(seq.pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        out = torch.tensor(slots, dtype=torch.int64)
        self.runner.req_to_token_pool.req_to_token[seq.row, start : start + n] = out
        return out

    def extend(self, seqs: list[SeqState], new_tokens: list[list[int]]) -> ForwardBatch:
        """An EXTEND batch appending ``new_tokens[i]`` to ``seqs[i]`` (after its cached tokens)."""
        prefix_lens = [len(s.tokens) for s in seqs]
        extend_lens = [len(t) for t in new_tokens]
        locs = [self._slots(s, len(t)) for s, t in zip(seqs, new_tokens, strict=True)]
        positions = [torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens, strict=True)]
        for s, t in zip(seqs, new_tokens, strict=True):
            s.tokens.extend(t)
        seq_lens = [len(s.tokens) for s in seqs]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64),
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor([s.row for s in seqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
        )

    def decode(self, seqs: list[SeqState], next_tokens: list[int]) -> ForwardBatch:
        """A DECODE batch feeding one token to each sequence."""
        positions = [len(s.tokens) for s in seqs]
        locs = torch.cat([self._slots(s, 1) for s in seqs])
        for s, t in zip(seqs, next_tokens, strict=True):
            s.tokens.append(t)
        seq_lens = [len(s.tokens) for s in seqs]
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.tensor(next_tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            req_pool_indices=torch.tensor([s.row for s in seqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=locs,
            seq_lens_cpu=seq_lens,
        )


def make_runner(model_path: Path, dtype: str = "float32", **server_args: Any) -> ModelRunner:
    """A CPU ModelRunner over ``model_path`` with a small KV pool unless told otherwise."""
    server_args.setdefault("max_total_tokens", 2048)
    args = ServerArgs(model_path=str(model_path), dtype=dtype, device="cpu", **server_args)
    config = ModelConfig.from_path(
        model_path, dtype=dtype, device="cpu", context_length=args.context_length,
        quantization=args.quantization,
    )
    return ModelRunner(config, RunnerSettings.from_args(args), "cpu")


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(tokens), vocab]`` for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()
