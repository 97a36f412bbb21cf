"""Offline throughput: the radixserve Engine vs transformers ``generate`` on the same prompts.

Both backends get the same random token-id prompts, decode greedily and ignore EOS, so every
request produces exactly ``--output-len`` tokens. Results are printed as JSON lines, one per
backend, then one comparing their outputs. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="local checkpoint; default: a tiny random llama")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--min-input-len", type=int, help="with --max-input-len: random lengths")
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="transformers generate batch size")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-running-requests", type=int, help="radixserve continuous-batch width")
    p.add_argument("--threads", type=int, default=2, help="torch threads for transformers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()
    if (args.min_input_len is None) != (args.max_input_len is None):
        p.error("--min-input-len and --max-input-len go together")
    return args


def make_prompts(args: argparse.Namespace, vocab_size: int, special: set[int]) -> list[list[int]]:
    rng = random.Random(args.seed)
    allowed = [t for t in range(vocab_size) if t not in special]
    lo, hi = (args.min_input_len, args.max_input_len) if args.min_input_len else (
        args.input_len, args.input_len)
    return [rng.choices(allowed, k=rng.randint(lo, hi)) for _ in range(args.num_prompts)]


def result(backend: str, prompts: list[list[int]], outputs: list[list[int]],
           wall_s: float) -> dict[str, Any]:
    out_tokens = sum(len(o) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "backend": backend,
        "num_prompts": len(prompts),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(out_tokens / wall_s, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / wall_s, 2),
    }


def run_radixserve(args: argparse.Namespace, model_path: str,
                   prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    from radixserve import Engine

    kwargs: dict[str, Any] = {"dtype": args.dtype, "device": args.device}
    if args.max_running_requests:
        kwargs["max_running_requests"] = args.max_running_requests
    params = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}
    with Engine(model_path=model_path, **kwargs) as engine:
        engine.generate(input_ids=prompts[0][:8], sampling_params={**params, "max_new_tokens": 2})
        engine.flush_cache()  # the warm-up prefix must not count as cached
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - start
    return [o["output_ids"] for o in outs], wall


def run_transformers(args: argparse.Namespace, model_path: str, prompts: list[list[int]],
                     dtype: torch.dtype, device: torch.device,
                     pad_id: int) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()

    def generate(batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)  # left padding keeps every prompt's end aligned
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                 pad_token_id=pad_id)
        return out[:, width:].tolist()

    generate([prompts[0][:8]])  # warm-up
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), args.batch_size):
        outputs.extend(generate(prompts[i:i + args.batch_size]))
    return outputs, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from radixserve.model_config import ModelConfig, resolve_device

    with tempfile.TemporaryDirectory(prefix="radixserve-bench-") as tmp:
        model_path = args.model_path
        if model_path is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tests/
            from tests.checkpoints import build_checkpoint

            model_path = str(build_checkpoint(Path(tmp) / "llama", "llama"))
        config = ModelConfig.from_path(model_path, dtype=args.dtype, device=args.device)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        special = set(tokenizer.all_special_ids) | set(config.eos_token_ids)
        prompts = make_prompts(args, config.vocab_size, special)

        outs, wall = run_radixserve(args, model_path, prompts)
        print(json.dumps(result("radixserve", prompts, outs, wall)), flush=True)
        if args.skip_transformers:
            return
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        hf_outs, hf_wall = run_transformers(args, model_path, prompts, config.torch_dtype,
                                            resolve_device(args.device), pad_id)
        print(json.dumps(result("transformers", prompts, hf_outs, hf_wall)), flush=True)
        same = sum(a == b for a, b in zip(outs, hf_outs, strict=True))
        print(json.dumps({"comparison": "greedy outputs identical", "identical_outputs": same,
                          "num_prompts": len(prompts),
                          "speedup": round(hf_wall / wall, 3)}), flush=True)


if __name__ == "__main__":
    main()
