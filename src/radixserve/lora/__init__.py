"""Multi-LoRA serving: PEFT adapters read from disk (``adapter``), their weights held in a
bounded pool of slots and applied to the model's linear layers (``lora_manager``).

See docs/lora.md for the user's side."""

from radixserve.lora.adapter import (
    LORA_TARGET_MODULES,
    LoRAAdapter,
    LoRAAdapterError,
    load_adapter,
)

__all__ = ["LORA_TARGET_MODULES", "LoRAAdapter", "LoRAAdapterError", "load_adapter"]
