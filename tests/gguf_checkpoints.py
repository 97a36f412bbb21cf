"""GGUF files for tests, written with the ``gguf`` package's own writer.

``convert_checkpoint`` turns one of ``tests/checkpoints.py``'s tiny Hugging Face checkpoints into
a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py`` lays one out: llama.cpp tensor names,
the hyper-parameters as ``{arch}.*`` metadata, and, for Llama, the query and key rows of each
head reordered (its two rotary halves interleaved). Weights are stored in F32 or, quantised with
``gguf.quants.quantize``, in Q8_0 (norms stay F32, as the converter keeps them). The tokenizer
and chat template go in as llama.cpp's ``tokenizer.*`` metadata.
"""

from __future__ import annotations

import json
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
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def llama_cpp_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face decoder tensor."""
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


def convert_checkpoint(hf_dir: Path, out: Path, qtype: str = "F32") -> Path:
    """Write ``hf_dir``'s weights and config as the GGUF file ``out``; return ``out``."""
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
    _add_tokenizer(writer, hf_dir)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, w in tensors.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        w = w.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, heads if "q_proj" in name else kv_heads)
        if qtype == "F32" or w.ndim == 1:
            writer.add_tensor(llama_cpp_name(name), w)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(llama_cpp_name(name), gguf.quants.quantize(w, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
