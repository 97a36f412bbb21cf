"""Decode steps replayed from traced graphs on CPU: the CPU's counterpart of CUDA graphs
(SGLang's ``CPUGraphRunner`` beside its ``CudaGraphRunner``, as there).

Why: a small model's decode step on a CPU spends about as long in Python as in its kernels.
SmolLM2-135M at 4 bits, batch 1, two cores: the 30 layers' kernels take about 5 ms, and the
Python around them (module calls, views, dispatch: some 1,500 ops a step) took 4 ms more. A
graph recorded once and replayed by TorchScript's C++ interpreter runs the same ops in the same
order on the same kernels, without the Python (9.4 -> 4.9 ms a step, same run).

How: ``torch.jit.trace`` records one decode forward per batch-size bucket: the ops with the
weights and the KV pool as constants and the batch's five tensors (token ids, positions,
request rows, sequence lengths, KV slots) as inputs. The buckets, static buffers and padding are
``CudaGraphRunner``'s (padding rows decode into the pool's padding page). A bucket is traced the
first time a batch needs it, on that batch (the trace's own run is its step), so sizes never
used cost nothing: a trace takes about 0.2 s for a 30-layer model.

What a trace cannot see: it records the ops of one run, so every decision Python took in it is
frozen. That is right for what depends on the batch size alone (the kernel chosen per row
bucket, the decode kernel, the layers' windows), and wrong for anything that reads the batch's
values in Python. ``ModelRunner`` therefore traces only what it knows to be of the first kind:
a decoder on the ``cpu`` attention backend, on one rank (no collective between ops), without
MoE layers (routing groups tokens in Python). Anything else decodes eagerly, with the reason in
the log; ``--disable-cuda-graph`` turns graphs off on CPU too, as in SGLang. LoRA is traced as
on CUDA: each row's adapter slot sits in a buffer the graph reads (``lora/graph_inputs.py``),
and the LoRA kernel groups the rows by slot itself, so one graph serves every mix of adapters.

``torch.jit`` is deprecated (torch 2.13 warns): its successor for this, ``torch.export`` with
AOTInductor, needs a fake (shape-only) implementation of each radixserve kernel first; a
TorchScript graph has no such need. The warning is silenced here, where the choice is made.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.lora.graph_inputs import LoRAGraphInputs
from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)

Graph = Callable[..., torch.Tensor]


class CpuGraphRunner(CudaGraphRunner):
    """Buckets, static buffers and padding from ``CudaGraphRunner``; each bucket's graph is a
    TorchScript trace of ``forward`` over the buffers' first rows, recorded at first use."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        device: torch.device,
        batch_sizes: list[int],
        lora_inputs: LoRAGraphInputs | None = None,
    ) -> None:
        super().__init__(forward, device, batch_sizes, use_cuda_graph=False,
                         lora_inputs=lora_inputs)
        self.traced: dict[int, Graph] = {}

    def capture(self) -> None:
        """Nothing ahead of time: each bucket is traced when a batch first needs it."""

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode and 0 < forward_batch.batch_size <= self.max_bs

    def _inputs(self, padded: int) -> tuple[torch.Tensor, ...]:
        return (
            self.input_ids[:padded], self.positions[:padded], self.req_pool_indices[:padded],
            self.seq_lens[:padded], self.out_cache_loc[:padded],
        )

    def _run(self, forward_batch: ForwardBatch, padded: int) -> torch.Tensor:
        bs = forward_batch.batch_size
        graph = self.traced.get(padded)
        if graph is None:
            graph, logits = self._trace(padded)
            self.traced[padded] = graph
            return logits[:bs]
        # Unoptimised: TorchScript's profiling executor would spend 2 s rewriting a 30-layer
        # graph on its second and third runs for no gain (the ops are the kernels either way),
        # and no pass may change what the ops compute.
        with torch.jit.optimized_execution(False):
            return graph(*self._inputs(padded))[:bs]

    def _trace(self, padded: int) -> tuple[Graph, torch.Tensor]:
        """The graph of bucket ``padded``, and the logits of the run it was recorded from (the
        current batch, already in the buffers)."""
        template = self._static_batch(padded)
        outputs: list[torch.Tensor] = []

        def step(
            input_ids: torch.Tensor, positions: torch.Tensor, req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
        ) -> torch.Tensor:
            batch = dataclasses.replace(
                template, input_ids=input_ids, positions=positions,
                req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
            )
            logits = self.forward(batch)
            outputs.append(logits)
            return logits

        start = time.perf_counter()
        with warnings.catch_warnings():
            # the batch size becomes a constant (intended: one graph per size), and the
            # deprecation the module docstring discusses
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            graph = torch.jit.trace(step, self._inputs(padded), check_trace=False)
        logger.info("CPU graph for decode batches of %d traced in %.2f s", padded,
                    time.perf_counter() - start)
        return graph, outputs[-1]
