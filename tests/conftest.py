"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import ARCHITECTURES, build_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once) and return the path of a tiny checkpoint for ``arch``."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def llama_path(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


@pytest.fixture(params=ARCHITECTURES)
def arch_path(request, checkpoint_factory) -> Path:
    return checkpoint_factory(request.param)
