"""Qwen3: the Llama decoder with RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from radixserve.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
