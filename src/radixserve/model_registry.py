"""Architecture name (``config.json`` ``architectures``) → model class, imported on first use.

The registry answers what the rest of the engine asks about architectures: which of a
checkpoint's names is supported (``supported_architecture``: ``ModelConfig`` asks it), whether
one is an encoder, which activation it implements, and which class builds it (``get_model_class``:
the model loader asks it). Importing it pulls in no torch model code, so configs and the CLI can
validate names; it sits beside ``model_config.py``, below ``model_executor``, whose
``models`` package it imports by name only when a class is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# architecture → (module under radixserve.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("phi3", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma2", "Gemma3ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert_classifier", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": (
        "bert_classifier", "XLMRobertaForSequenceClassification"
    ),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)
# Bidirectional encoders: embedding-only, no KV cache, no generation.
# Sequence classifiers (cross-encoders): encoders whose output is one logit per label.
CLASSIFIER_ARCHITECTURES: tuple[str, ...] = (
    "BertForSequenceClassification", "XLMRobertaForSequenceClassification"
)
ENCODER_ARCHITECTURES: tuple[str, ...] = ("BertModel", *CLASSIFIER_ARCHITECTURES)
# The MLP activation each family implements.
_HIDDEN_ACT = {
    **dict.fromkeys(ENCODER_ARCHITECTURES, "gelu"),
    "Gemma2ForCausalLM": "gelu_pytorch_tanh",
    "Gemma3ForCausalLM": "gelu_pytorch_tanh",
}
# Families whose attention layers honour ``sliding_window`` (the others attend over everything).
SLIDING_WINDOW_ARCHITECTURES: tuple[str, ...] = (
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
    "MixtralForCausalLM",
)


def supported_architecture(names: list[str]) -> str | None:
    """The first of a checkpoint's ``architectures`` that radixserve implements, if any."""
    return next((name for name in names if name in _MODELS), None)


def is_encoder(architecture: str) -> bool:
    """Whether ``architecture`` is a bidirectional encoder (embeddings only, no KV cache)."""
    return architecture in ENCODER_ARCHITECTURES


def is_classifier(architecture: str) -> bool:
    """Whether ``architecture`` is a sequence classifier (its output: one logit per label)."""
    return architecture in CLASSIFIER_ARCHITECTURES


def hidden_act_of(architecture: str) -> str:
    """The activation (``config.json`` ``hidden_act``) that ``architecture``'s class implements."""
    return _HIDDEN_ACT.get(architecture, "silu")


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; ``ValueError`` names the supported ones.

    Typed as any module: naming the model classes here, even for a type checker, would import
    ``model_executor`` (which imports ``model_config`` and so this module) from below it."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"radixserve.model_executor.models.{module_name}")
    return getattr(module, class_name)
