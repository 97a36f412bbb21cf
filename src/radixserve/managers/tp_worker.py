"""The scheduler's handle on the model: one ``ForwardBatch`` in, sampled tokens out.

With tensor parallelism each rank's scheduler owns one worker; rank 0 broadcasts the batch. The
scheduler never calls the model runner directly, so that seam stays in one place.
"""

from __future__ import annotations

import torch

from radixserve.layers.sampler import SampleOutput
from radixserve.model_config import ModelConfig
from radixserve.model_executor.forward_batch import ForwardBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


class TpModelWorker:
    """Owns the ``ModelRunner`` (weights, KV pool and its allocator, request slots)."""

    def __init__(
        self, model_config: ModelConfig, server_args: ServerArgs, device: torch.device
    ) -> None:
        self.model_runner = ModelRunner(model_config, server_args, device)

    @torch.inference_mode()
    def forward_batch_generation(self, forward_batch: ForwardBatch) -> SampleOutput:
        logits = self.model_runner.forward(forward_batch)
        return self.model_runner.sample(logits, forward_batch)

    @torch.inference_mode()
    def forward_batch_embedding(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """One embedding per request of an EXTEND batch, float32 ``[batch_size, hidden]``."""
        return self.model_runner.embed(forward_batch)
