"""Fixtures of the model-executor tests: RoPE-scaled checkpoints and the transformers reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import build_checkpoint

ROPE_SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.fixture(scope="session")
def rope_checkpoint(tmp_path_factory):
    """Build (once) a llama checkpoint with RoPE scaling ``kind`` (a ``ROPE_SCALINGS`` key)."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-rope-{kind}")
            cache[kind] = build_checkpoint(out, "llama", rope_parameters=dict(ROPE_SCALINGS[kind]))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """Load (once per path) the transformers model of a checkpoint in float32."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def get(path: Path) -> torch.nn.Module:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get

