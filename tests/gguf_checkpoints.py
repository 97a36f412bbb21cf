"""GGUF files for tests, written with the ``gguf`` package's own writer.

``convert_checkpoint`` turns one of ``tests/checkpoints.py``'s tiny Hugging Face checkpoints into
a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py`` lays one out: llama.cpp tensor names,
the hyper-parameters as ``{arch}.*`` metadata, and, for Llama, the query and key rows of each
head reordered (its two rotary halves interleaved). Weights are stored in F32 or, quantised with
``gguf.quants.quantize``, in Q8_0 (norms stay F32, as the converter keeps them). The tokenizer
and chat template go in as llama.cpp's ``tokenizer.*`` metadata. MoE checkpoints (Mixtral,
Qwen2-MoE, Qwen3-MoE) get the converter's stacked expert tensors (``blk.N.ffn_up_exps``
``[experts, rows, cols]``), router (``ffn_gate_inp``), shared expert (``*_shexp``, its gate
stored 1-D as llama.cpp declares it) and ``{arch}.expert_*`` metadata.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# an expert's projection (Qwen MoE's names, Mixtral's) → the stacked tensor holding all experts'
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
              "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
              "Qwen3MoeForCausalLM": "qwen3moe", "Phi3ForCausalLM": "phi3"}


def llama_cpp_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face decoder tensor (a stacked expert tensor already has
    its llama.cpp name)."""
    if hf_name.startswith("blk."):
        return hf_name
    globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                "lm_head": "output"}
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in globals_:
        return f"{globals_[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama q/k projection (``LlamaModel.permute``)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _add_tokenizer(writer, hf_dir: Path) -> None:
    """The checkpoint's byte-level BPE tokenizer as llama.cpp's ``gpt2`` tokenizer metadata."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL / NORMAL
    writer.add_token_merges(merges)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _stack_experts(tensors: dict[str, np.ndarray], writer, cfg: dict, arch: str,
                   experts: int) -> dict[str, np.ndarray]:
    """The MoE metadata, and ``tensors`` with each layer's per-expert projections replaced by
    one stacked tensor per projection (keyed by its llama.cpp name)."""
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, w in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = w
            continue
        layer, expert, proj = m.groups()
        stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.weight", {})[int(expert)] = w
    for name, by_expert in stacks.items():
        assert sorted(by_expert) == list(range(experts)), name
        out[name] = np.stack([by_expert[e] for e in range(experts)])
    return out


def convert_checkpoint(hf_dir: Path, out: Path, qtype: str = "F32",
                       extra_tensors: dict[str, np.ndarray] | None = None,
                       rope_dims: int | None = None) -> Path:
    """Write ``hf_dir``'s weights and config as the GGUF file ``out``; return ``out``.
    ``extra_tensors`` are written as they are; ``rope_dims`` overrides the rotary dimension a
    Phi-3 file states (its head_dim by default)."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["architectures"][0]]
    tensors = load_file(hf_dir / "model.safetensors")
    writer = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(0 if qtype == "F32" else 7)  # ALL_F32 / MOSTLY_Q8_0
    if arch == "phi3":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        writer.add_rope_dimension_count(rope_dims or head_dim)
        if cfg.get("sliding_window"):
            writer.add_sliding_window(cfg["sliding_window"])
    _add_tokenizer(writer, hf_dir)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        tensors = _stack_experts(tensors, writer, cfg, arch, experts)
    for name, w in tensors.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        w = w.astype(np.float32)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, heads if "q_proj" in name else kv_heads)
        if qtype == "F32" or w.ndim == 1:
            writer.add_tensor(llama_cpp_name(name), w)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(llama_cpp_name(name), gguf.quants.quantize(w, q), raw_dtype=q)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
