"""Build a random-weight checkpoint with Llama-3-8B's shape on the GPU, locally (the GPU check's
machine has no internet): hidden 4096, 32 layers, 32 heads / 8 KV heads (head_dim 128),
intermediate 14336, vocab 128256, rope_theta 500000, untied embeddings; bfloat16 safetensors,
about 16 GB. Weights are initialised on the GPU (seconds, where a CPU takes minutes). It shares
the benchmark models' small BPE tokenizer (ids past it decode to nothing, as for ``small``).

Output: ``<out>/llama3-8b-shape`` (default ``~/.cache/radixserve/bench``); kept when it exists
unless ``--force``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.checkpoints import build_tokenizer  # noqa: E402

DEFAULT_OUT = Path.home() / ".cache" / "radixserve" / "bench"
NAME = "llama3-8b-shape"


def build(out_dir: Path, seed: int) -> dict[str, object]:
    import transformers as tf

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=8192, model_max_length=8192)
    config = tf.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    config.dtype = "bfloat16"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = tf.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")
    params = sum(p.numel() for p in model.parameters())
    return {"model": NAME, "path": str(out_dir), "parameters": params,
            "build_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    target = args.out / NAME
    if (target / "config.json").is_file() and not args.force:
        print(json.dumps({"model": NAME, "path": str(target), "status": "exists"}), flush=True)
        return
    if not torch.cuda.is_available():
        raise SystemExit("make_gpu_model builds on a CUDA GPU")
    print(json.dumps(build(target, args.seed)), flush=True)


if __name__ == "__main__":
    main()
