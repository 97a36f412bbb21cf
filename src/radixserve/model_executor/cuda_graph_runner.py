"""Decode steps replayed from CUDA graphs, SGLang's ``CudaGraphRunner`` as the model.

A decode step of a small model on a GPU is bound by the host: hundreds of kernel launches and
thousands of torch ops, each dispatched from Python, for a few milliseconds of GPU work. A CUDA
graph records the launches of one forward once and replays them with one call.

A graph replays fixed addresses and shapes, so:

- the runner owns **static input buffers** sized for the largest batch: token ids, positions,
  request-slot indices (rows of ``req_to_token``), sequence lengths and KV output locations (the
  attention metadata the ``triton`` backend reads; it reads nothing from the host in decode);
- it captures one graph per **batch-size bucket** (``capture_batch_sizes``: SGLang's list, up to
  ``--cuda-graph-max-bs``), each over the first ``bs`` rows of the buffers;
- ``replay`` copies a batch into the buffers, **pads** it to the next captured size (padding rows
  decode token 0 at position 0 of request row 0, with sequence length 1, and write their KV into
  slot 0, the pool's padding page that no request owns), replays, and returns the first
  ``batch_size`` rows of the captured logits. Sampling stays outside the graph;
- with LoRA, the rows' adapter slots are inputs too (``lora/graph_inputs.py``: one LoRA
  segment per row, padding rows without an adapter), written before each replay.

Everything but ``torch.cuda.graph`` itself is device independent: on CPU (``use_cuda_graph=False``,
for tests) a "captured graph" calls the forward on the same static buffers at replay, so the
buffer handling and the padding are tested on any machine. Only CUDA builds it with real graphs.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.lora.graph_inputs import LoRAGraphInputs

logger = logging.getLogger(__name__)

# Padding rows: request row 0 (whatever it holds is only read, and masked out by the slicing),
# sequence length 1, KV written to slot 0 of the padding page.
PAD_REQ_POOL_INDEX = 0
PAD_SEQ_LEN = 1
PAD_OUT_CACHE_LOC = 0


def capture_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's bucket list (1, 2, 4, 8, 12, then every 8 from 16), cut at ``max_bs``, with
    ``max_bs`` itself as the last bucket."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    buckets = [1, 2, 4, 8, 12, *range(16, max_bs + 1, 8)]
    sizes = [bs for bs in buckets if bs <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


# The triton backend's decode splits each request's KV into this many parts, each keeping a
# float32 partial output and log-sum-exp per query head (layers/attention/triton_kernels.py).
_DECODE_KV_SPLITS = 8
# What the graphs' memory pool may hold beyond one step's live tensors (the caching allocator's
# blocks are rounded up and not all reused across the captured sizes), and each graph's own
# bookkeeping. Estimates: the runner logs the measured figure next to this one.
_POOL_SLACK = 2
_PER_GRAPH_BYTES = 1 << 20


def graph_memory_bytes(
    batch_sizes: list[int],
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """The device memory the decode graphs of ``batch_sizes`` are expected to keep, counted in
    the KV budget before the pool is sized (the issue's "the memory it takes is counted in the
    pool's budget"): captures share one memory pool, largest first, so it holds about one layer's
    temporaries of the largest batch (the residual and normed activations, q/k/v, the MLP's
    gate-up and product, attention's split-KV partials), and the logits of every size, each
    graph's output staying alive beside the others (on an H200 the estimate without them was
    0.06 GiB where the runner measured 0.36)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_row = itemsize * (
        4 * hidden_size
        + (num_heads + 2 * num_kv_heads) * head_dim
        + 3 * intermediate_size
    ) + 4 * num_heads * (head_dim + 1) * _DECODE_KV_SPLITS
    logits = sum(batch_sizes) * vocab_size * itemsize
    return (max(batch_sizes) * per_row * _POOL_SLACK + logits
            + len(batch_sizes) * _PER_GRAPH_BYTES)


@dataclass
class _Graph:
    """One captured batch size: the batch over the static buffers it was captured with, the
    logits tensor the forward wrote, and the CUDA graph (None on CPU: replay runs the forward)."""

    batch: ForwardBatch
    logits: torch.Tensor
    graph: torch.cuda.CUDAGraph | None


class CudaGraphRunner:
    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        device: torch.device,
        batch_sizes: list[int],
        use_cuda_graph: bool,
        lora_inputs: LoRAGraphInputs | None = None,
    ) -> None:
        """``forward``: one decode step of the model (attention metadata and model), returning
        ``[batch_size, vocab]`` logits; ``use_cuda_graph``: capture real CUDA graphs (CUDA only),
        else replay calls ``forward`` on the static buffers; ``lora_inputs``: the adapter slots'
        buffers that ``forward`` reads with LoRA on (sized for the largest batch here)."""
        if use_cuda_graph and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.forward = forward
        self.device = device
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.use_cuda_graph = use_cuda_graph
        if lora_inputs is not None and lora_inputs.max_bs < self.max_bs:
            raise ValueError(f"LoRA graph inputs for {lora_inputs.max_bs} rows, graphs up to "
                             f"{self.max_bs}")
        self.lora_inputs = lora_inputs
        int64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(self.max_bs, **int64)
        self.positions = torch.zeros(self.max_bs, **int64)
        self.req_pool_indices = torch.full((self.max_bs,), PAD_REQ_POOL_INDEX, **int64)
        self.seq_lens = torch.full((self.max_bs,), PAD_SEQ_LEN, **int64)
        self.out_cache_loc = torch.full((self.max_bs,), PAD_OUT_CACHE_LOC, **int64)
        self.graphs: dict[int, _Graph] = {}
        self.memory_pool = None

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[PAD_SEQ_LEN] * bs,
        )

    def capture(self) -> None:
        """Capture every batch size, largest first (the smaller graphs reuse its memory pool).
        The padding rows' inputs are what each capture runs on. All captures and their warm-ups
        run on one side stream: the caching allocator keeps a freed block for the stream that
        freed it, so a stream per size left each warm-up's blocks idle (with a stream per size,
        12 sizes took 0.31-0.52 GiB more than estimated on an H200; how much of that this was
        is not measured yet); what the warm-ups leave is released at the end."""
        stream = torch.cuda.Stream(self.device) if self.use_cuda_graph else None
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs)
            if stream is None:
                self.graphs[bs] = _Graph(batch, self.forward(batch), None)
                continue
            # Warm up outside the graph (Triton compiles, allocators settle), then record.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            if self.memory_pool is None:
                self.memory_pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream):
                logits = self.forward(batch)
            self.graphs[bs] = _Graph(batch, logits, graph)
        if stream is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the graphs' private pool stays; the warm-ups' blocks go

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.forward_mode.is_decode
            and 0 < forward_batch.batch_size <= self.max_bs
            and bool(self.graphs)
        )

    def padded_batch_size(self, bs: int) -> int:
        """The smallest captured batch size that holds ``bs`` requests."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[batch_size, vocab]`` of a decode batch, from the graph of the next captured
        size; the KV of its tokens is written as the plain forward writes it."""
        bs = forward_batch.batch_size
        padded = self.padded_batch_size(bs)
        self.input_ids[:bs].copy_(forward_batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(forward_batch.positions, non_blocking=True)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens, non_blocking=True)
        self.out_cache_loc[:bs].copy_(forward_batch.out_cache_loc, non_blocking=True)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.req_pool_indices[bs:padded].fill_(PAD_REQ_POOL_INDEX)
            self.seq_lens[bs:padded].fill_(PAD_SEQ_LEN)
            self.out_cache_loc[bs:padded].fill_(PAD_OUT_CACHE_LOC)
        if self.lora_inputs is not None:
            self.lora_inputs.write(forward_batch.lora_slots, bs, padded)
        return self._run(forward_batch, padded)

    def _run(self, forward_batch: ForwardBatch, padded: int) -> torch.Tensor:
        """The first ``forward_batch.batch_size`` rows of the logits of the graph of size
        ``padded``, its inputs already in the static buffers."""
        bs = forward_batch.batch_size
        entry = self.graphs[padded]
        # Host-side lengths for backends that read them (the eager replay on CPU); a CUDA graph
        # reads only the device buffers.
        entry.batch.seq_lens_cpu[:] = [*forward_batch.seq_lens_cpu, *[PAD_SEQ_LEN] * (padded - bs)]
        if entry.graph is not None:
            entry.graph.replay()
            # A copy: the next replay overwrites the graph's logits (the overlap schedule may
            # launch it before these are sampled).
            return entry.logits[:bs].clone()
        return self.forward(entry.batch)[:bs]
