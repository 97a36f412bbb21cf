"""Phi-3 (and Mistral): the Llama decoder with every layer's attention in a sliding window.

Phi-3's checkpoint stores q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``);
``split_checkpoint_tensors`` presents each as its parts (narrowed lazily, so a tensor-parallel
rank still reads only its rows), which fill the fused layers shard by shard as Llama's do.
Its ``longrope``/``su`` RoPE scaling (the 128k variants) and a partial rotary factor are refused
by ``ModelConfig`` / here, naming them.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.layers.linear_method import WeightSource
from radixserve.model_config import ModelConfig
from radixserve.model_executor.models.llama import LlamaForCausalLM

TensorList = list[tuple[str, Callable[[], WeightSource]]]


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with ``sliding_window`` (when set) on every layer, as transformers' Mistral."""

    @staticmethod
    def sliding_window(config: ModelConfig) -> int | None:
        window = config.hf_config.get("sliding_window")
        return int(window) if window else None


class Phi3ForCausalLM(MistralForCausalLM):
    def __init__(self, config: ModelConfig, *args: object, **kwargs: object) -> None:
        hf = config.hf_config
        factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        factor = factor if factor is not None else hf.get("partial_rotary_factor", 1.0)
        if float(factor) != 1.0:
            raise ValueError(f"partial_rotary_factor {factor} is not supported for Phi-3 (only 1)")
        super().__init__(config, *args, **kwargs)  # type: ignore[arg-type]

    def split_checkpoint_tensors(self, tensors: TensorList) -> TensorList:
        """``...qkv_proj.weight`` → ``q_proj``/``k_proj``/``v_proj``, ``...gate_up_proj.weight``
        → ``gate_proj``/``up_proj``: row ranges of the fused tensor."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        parts = {
            ".qkv_proj.": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
            ".gate_up_proj.": [("gate_proj", 0, c.intermediate_size),
                               ("up_proj", c.intermediate_size, c.intermediate_size)],
        }
        out: TensorList = []
        for name, source in tensors:
            fused = next((key for key in parts if key in name), None)
            if fused is None:
                out.append((name, source))
                continue
            for part, start, size in parts[fused]:
                out.append((name.replace(fused, f".{part}."), _rows(source, start, size)))
        return out


def _rows(source: Callable[[], WeightSource], start: int, size: int,
          ) -> Callable[[], WeightSource]:
    return lambda: source().narrow(0, start, size)
