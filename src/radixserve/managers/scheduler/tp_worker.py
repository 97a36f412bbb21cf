"""The scheduler's handle on the model: one ``ForwardBatch`` in, sampled tokens out.

Every rank's scheduler owns one worker and builds the same batch (the schedulers take identical
decisions), so a batch never travels between ranks; only what a rank cannot compute itself does:

- tensor parallelism: the layers all-reduce and all-gather inside the model; after sampling, the
  tokens of the stage's first rank are broadcast to the others, so that no rounding difference
  between ranks can ever make their schedulers disagree;
- pipeline parallelism: a stage other than the first receives the previous stage's activations,
  a stage other than the last sends its own to the next one (``hidden_states`` and ``residual``
  stacked, ``[2, num_tokens, hidden]``: the receiver knows the shape from its own batch) and
  returns no tokens; the scheduler's pipeline loop hands the last stage's tokens round.

The scheduler never calls the model runner directly, so that seam stays in one place.
"""

from __future__ import annotations

import torch

from radixserve.distributed import ParallelState
from radixserve.forward_batch import ForwardBatch, StageActivations
from radixserve.layers.sampler import SampleOutput
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_runner import KVShare, ModelRunner, RunnerSettings


class TpModelWorker:
    """Owns the ``ModelRunner`` (weights, KV pool and its allocator, request slots)."""

    def __init__(
        self,
        model_config: ModelConfig,
        settings: RunnerSettings,
        device: torch.device,
        parallel: ParallelState | None = None,
        kv_share: KVShare | None = None,
    ) -> None:
        self.parallel = parallel or ParallelState.single()
        self.model_runner = ModelRunner(model_config, settings, device, self.parallel, kv_share)
        self.hidden_size = model_config.hidden_size

    @torch.inference_mode()
    def forward_batch_generation(self, forward_batch: ForwardBatch) -> SampleOutput | None:
        """The batch's sampled tokens; None on a pipeline stage other than the last."""
        info, runner = self.parallel.info, self.model_runner
        previous = None
        if not info.is_first_stage:
            assert self.parallel.p2p is not None
            stacked = self.parallel.p2p.recv_tensor(
                (2, forward_batch.num_tokens, self.hidden_size),
                runner.dtype,
                runner.device,
                src=info.stage_rank(info.pp_rank - 1),
            )
            previous = StageActivations(stacked[0], stacked[1])
        out = runner.forward(forward_batch, previous)
        if isinstance(out, StageActivations):
            assert self.parallel.p2p is not None
            self.parallel.p2p.send_tensor(
                torch.stack([out.hidden_states, out.residual]),
                dst=info.stage_rank(info.pp_rank + 1),
            )
            return None
        result = runner.sample(out, forward_batch)
        if self.parallel.tp.size > 1:
            result.next_token_ids = self.parallel.tp.broadcast(result.next_token_ids.contiguous())
        result.start_host_copy()
        return result

    @torch.inference_mode()
    def forward_batch_embedding(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """One embedding per request of an EXTEND batch, float32 ``[batch_size, hidden]``."""
        return self.model_runner.embed(forward_batch)
