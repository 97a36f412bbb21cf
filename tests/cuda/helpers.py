"""What the GPU check's tests share: the device they run on and the checkpoints they build.

They run on CUDA and are skipped without it. ``RADIXSERVE_CUDA_TEST_DEVICE=cpu`` (with
``TRITON_INTERPRET=1``) runs them on a CPU instead, to check the tests themselves where no GPU is
at hand: everything but the CUDA graphs and the compiled kernels then runs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_runner import ModelRunner, RunnerSettings
from radixserve.server_args import ServerArgs
from tests.model_executor.harness import ManualSlots, SeqState

DEVICE = os.environ.get("RADIXSERVE_CUDA_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
requires_device = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (the GPU check: benchmarks/gpu_check.sh)",
)
# A tiny Llama whose head_dim is 64 (the test checkpoints' default is 16).
HEAD_DIM_64 = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64}


def make_runner(model_path: Path, dtype: str = "float32", **server_args: Any) -> ModelRunner:
    """A ModelRunner on ``DEVICE`` with a small KV pool unless told otherwise."""
    server_args.setdefault("max_total_tokens", 4096)
    args = ServerArgs(model_path=str(model_path), dtype=dtype, device=DEVICE, **server_args)
    config = ModelConfig.from_path(model_path, dtype=dtype, device=DEVICE,
                                   context_length=args.context_length)
    return ModelRunner(config, RunnerSettings.from_args(args), DEVICE)


class DeviceSlots(ManualSlots):
    """``ManualSlots`` whose batches live on ``DEVICE``."""

    def extend(self, seqs: list[SeqState], new_tokens: list[list[int]]) -> ForwardBatch:
        return _on_device(super().extend(seqs, new_tokens))

    def decode(self, seqs: list[SeqState], next_tokens: list[int]) -> ForwardBatch:
        return _on_device(super().decode(seqs, next_tokens))


def _on_device(fb: ForwardBatch) -> ForwardBatch:
    moved = {f.name: getattr(fb, f.name).to(DEVICE) for f in dataclasses.fields(fb)
             if isinstance(getattr(fb, f.name), torch.Tensor)}
    return dataclasses.replace(fb, **moved)
