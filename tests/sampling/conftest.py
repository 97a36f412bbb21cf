"""Fixtures for the sampling tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state, so statistical bounds are reproducible."""
    torch.manual_seed(1234)
