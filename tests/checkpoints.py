"""Tiny random-weight Hugging Face checkpoints for tests, built locally (no hub).

Each checkpoint is a real directory: config.json, generation_config.json, safetensors weights
written by ``transformers`` (fixed seed) and a byte-level BPE tokenizer trained here with the
``tokenizers`` library. The radixserve loading code runs on them unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 512

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Built on request only (``build_checkpoint``), tested by their own files: Gemma's norms start
# at zero in transformers, so these get random norm weights (``_perturb_norms``) and a larger
# initialisation, to make every scale and cap matter.
EXTRA_ARCHITECTURES = ("gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def build_tokenizer(out_dir: Path, chat_template: str = CHAT_TEMPLATE,
                    extra_special_tokens: tuple[str, ...] = (), vocab_size: int = VOCAB_SIZE,
                    model_max_length: int = 4096) -> int:
    """Train a byte-level BPE tokenizer on Python's bundled pydoc topics and save it in
    transformers' format (``extra_special_tokens`` after the usual ones, as a model's control
    tokens); returns its size. The benchmarks' checkpoints use it too, larger."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "add_bos_token": False,
                "model_max_length": model_max_length,
                "chat_template": chat_template,
            }
        )
    )
    return tok.get_vocab_size()


def _hf_config(arch: str, vocab_size: int):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            **common, rope_theta=10000.0, tie_word_embeddings=False
        )
    if arch == "mistral":
        return tf.MistralForCausalLM, tf.MistralConfig(
            **common, rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False
        )
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            **common, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False
        )
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(
            **common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True,
            use_sliding_window=False,
        )
    if arch == "phi3":
        return tf.Phi3ForCausalLM, tf.Phi3Config(
            **common, sliding_window=None, initializer_range=0.1, tie_word_embeddings=False,
        )
    if arch == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=None, initializer_range=0.1, tie_word_embeddings=False,
        )
    if arch == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            **common, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, initializer_range=0.1,
            use_sliding_window=False, tie_word_embeddings=False,
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, head_dim=32, moe_intermediate_size=32, num_local_experts=16,
            num_experts_per_tok=8, norm_topk_prob=True, initializer_range=0.1,
            use_sliding_window=False, tie_word_embeddings=False,
        )
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.1,
            tie_word_embeddings=True,
        )
    if arch == "gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **common, head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        )
    raise ValueError(f"unknown test architecture {arch!r}")


def _perturb_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)


def build_checkpoint(out_dir: Path, arch: str = "llama", seed: int = 0,
                     max_shard_size: str | None = None, chat_template: str = CHAT_TEMPLATE,
                     extra_special_tokens: tuple[str, ...] = (), **config_overrides) -> Path:
    """Write a tiny random checkpoint of ``arch`` to ``out_dir`` and return it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, chat_template, extra_special_tokens)
    vocab = len(json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"])
    model_cls, config = _hf_config(arch, vocab)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if arch in EXTRA_ARCHITECTURES:
        _perturb_norms(model)
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def kv_scales_of(layers: int) -> list[tuple[float, float]]:
    """A (k_scale, v_scale) per layer, each layer its own and far enough from 1 that codes under
    them differ from codes at unit scale."""
    return [(0.125 * (layer + 1), 2.0 * (layer + 1)) for layer in range(layers)]


def add_kv_scales(checkpoint: Path) -> list[tuple[float, float]]:
    """Give the checkpoint at ``checkpoint`` (one safetensors file) a k_scale and a v_scale per
    decoder layer, as an fp8-KV-calibrated checkpoint carries them; returns them."""
    from safetensors.torch import load_file, save_file

    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    (weights,) = checkpoint.glob("*.safetensors")
    tensors = load_file(weights)
    scales = kv_scales_of(layers)
    for layer, (k, v) in enumerate(scales):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, weights, metadata={"format": "pt"})
    return scales
