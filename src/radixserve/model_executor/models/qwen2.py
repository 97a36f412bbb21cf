"""Qwen2: the Llama decoder with a bias on the q, k and v projections (not on o_proj)."""

from __future__ import annotations

from radixserve.model_config import ModelConfig
from radixserve.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config: ModelConfig) -> bool:
        return True
