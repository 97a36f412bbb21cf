"""Fixtures of the GPU check: checkpoints built here (the GPU machine has no internet) and the
transformers reference on the same device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.cuda.helpers import DEVICE, HEAD_DIM_64
from tests.engine.conftest import strict_env  # noqa: F401 - a fixture


@pytest.fixture(scope="session")
def llama64_path(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-llama-hd64"), "llama", **HEAD_DIM_64)


@pytest.fixture(scope="session")
def hf_on_device():
    """transformers' model of a checkpoint on ``DEVICE`` in ``dtype`` (loaded once each)."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[Path, torch.dtype], torch.nn.Module] = {}

    def get(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        if (path, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            cache[path, dtype] = model.to(DEVICE).eval()
        return cache[path, dtype]

    return get
