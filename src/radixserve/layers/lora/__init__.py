"""The batched LoRA op and the per-step batch description it reads (see ``lora_op``)."""

from radixserve.layers.lora.lora_op import LoRABatchInfo, LoRADelta

__all__ = ["LoRABatchInfo", "LoRADelta"]
