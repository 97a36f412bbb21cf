"""Architecture name (``config.json`` ``architectures``) → model class, imported on first use.

Importing this module pulls in no torch model code, so configs and the CLI can validate names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.model_executor.models.llama import LlamaForCausalLM

# architecture → (module under radixserve.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing ``architecture``; ``ValueError`` names the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"radixserve.model_executor.models.{module_name}")
    return getattr(module, class_name)
