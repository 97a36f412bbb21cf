"""The tensors of a GGUF file, under the names of a Hugging Face checkpoint.

llama.cpp names a decoder's tensors ``blk.N.attn_q.weight``, ``token_embd.weight``, ...;
``gguf_weights`` gives each one under the name our models' loaders expect
(``model.layers.N.self_attn.q_proj.weight``, ...) as a lazy ``GgufTensor``
(``layers/quantization/gguf.py``), so ``model_loader.fill_parameters`` fills the model from a
GGUF file exactly as from safetensors: fused layers, tensor-parallel narrowing, tied LM head,
the check that nothing is missing.

One layout difference: llama.cpp's converter stores a Llama model's query and key projections
with each head's rows reordered (the two rotary halves interleaved, for its RoPE kernel), which
``_llama_qk_row_order`` undoes. Qwen2/Qwen3 files are stored in Hugging Face's order. Gemma 2/3
files store each RMSNorm weight as ``1 + w`` (llama.cpp's norm has no offset) and name the extra
norms differently; Phi-3 files keep the fused ``qkv_proj`` and ``gate_up_proj`` (``attn_qkv``,
``ffn_up``);
``gguf_weights`` gives the checkpoint's ``w`` back, which ``GemmaRMSNorm`` loads as ``1 + w``.
MoE files stack each projection of all experts in one 3-D tensor (``blk.N.ffn_up_exps``):
each expert's matrix is given as its own lazy tensor (only the experts a rank holds are read).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from radixserve.gguf_file import gguf_hf_config, gguf_tensors
from radixserve.layers.quantization.gguf import GgufTensor

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (qwen2moe, qwen3moe, llama with experts = Mixtral): the router and the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The experts' weights, stacked [experts, rows, cols] in one tensor per projection: one
# Hugging Face tensor per expert (``mlp.experts.E.up_proj``)
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
# Gemma's four norms per layer
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# Phi-3 keeps its checkpoint's fused projections (the model splits them, as from safetensors)
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_LAYER_NAMES_BY_ARCH = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES,
                        "phi3": _PHI3_LAYER_NAMES}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor, or None for one we do not map."""
    names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if m := _LAYER_TENSOR.match(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in names:
            return f"model.layers.{layer}.{names[kind]}.{suffix}"
    elif (m := _GLOBAL_TENSOR.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _llama_qk_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Stored row of each Hugging Face row of a Llama q/k projection ``[heads * head_dim, ..]``.

    The converter maps Hugging Face row ``h * d + s * d/2 + i`` (head ``h``, half ``s``, index
    ``i``) to stored row ``h * d + 2 * i + s``.
    """
    head_dim = rows // num_heads
    half = head_dim // 2
    hf_rows = np.arange(rows)
    head, within = np.divmod(hf_rows, head_dim)
    s, i = np.divmod(within, half)
    return head * head_dim + 2 * i + s


def gguf_weights(path: str | Path) -> list[tuple[str, Callable[[], GgufTensor]]]:
    """(Hugging Face name, a function giving the lazy tensor) for every tensor of the file;
    tensors we do not map keep their GGUF name (the loader reports them as unexpected)."""
    config, _ = gguf_hf_config(path)
    arch = config["gguf_architecture"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: list[tuple[str, Callable[[], GgufTensor]]] = []
    for tensor in gguf_tensors(path):
        if m := _LAYER_TENSOR.match(tensor.name):
            layer, kind, suffix = m.groups()
            if kind == "ffn_gate_up_exps":
                # gguf lists this fused form only for architectures we do not load; the order
                # of its halves is not confirmed here, so it is refused rather than guessed
                raise ValueError(f"{tensor.name}: fused gate/up expert tensors "
                                 f"(ffn_gate_up_exps) are not supported in {arch!r} files")
            if kind in _EXPERT_NAMES:
                experts = int(tensor.shape[-1])  # ggml: outermost last
                out.extend(
                    (f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[kind]}.{suffix}",
                     lambda t=tensor, e=e: GgufTensor(t, expert=e))
                    for e in range(experts)
                )
                continue
            if kind == "ffn_gate_inp_shexp":  # stored [hidden] by llama.cpp: Linear(hidden, 1)
                out.append((hf_name(tensor.name, arch) or tensor.name,
                            lambda t=tensor: GgufTensor(t).load().reshape(1, -1)))
                continue
        name = hf_name(tensor.name, arch) or tensor.name
        order = None
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if arch == "llama" and kind in heads and len(tensor.shape) == 2:
            order = _llama_qk_row_order(int(tensor.shape[1]), int(heads[kind]))
        if arch in _GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            out.append((name, lambda t=tensor: GgufTensor(t).load() - 1.0))
            continue
        out.append((name, lambda t=tensor, o=order: GgufTensor(t, o)))
    return out


def gguf_weight_bytes(path: str | Path, tied: bool, dtype: torch.dtype) -> int:
    """Bytes the file's weights take once dequantised to ``dtype`` (from the header only)."""
    return dtype.itemsize * sum(math.prod(t.shape) for t in gguf_tensors(path)
                                if not (tied and t.name == "output.weight"))
