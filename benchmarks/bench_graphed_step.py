"""What the GPU gives a decode step of a checkpoint's shape: a plain-torch step captured in one
CUDA graph, next to the bandwidth floor of the same step.

The step is the model's arithmetic and nothing else: embedding lookup, per layer RMSNorm, one
fused QKV matmul (+ bias where the checkpoint has one), neox rotary, attention of one query per
request over a dense ``[batch, kv_heads, context, head_dim]`` cache (SDPA, GQA), output
projection, RMSNorm, gate/up matmul, SiLU-and-mul, down projection, and the final norm and
``lm_head``: random weights of the checkpoint's sizes and dtype, no paging, no scheduler, no
sampling. Replayed from one CUDA graph, it is the time a serving engine's decode step could take
on this GPU without host overhead; the issue's target for radixserve is 0.9x of it.

The bandwidth floor reads every weight once and every request's KV once at the measured
device-copy bandwidth (``2 * bytes / copy time``, read plus write, as ``machine_limits.py``).

Prints one JSON line per batch size, and one with the copy bandwidth. CUDA only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def copy_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / best / 1e9


class Shape:
    def __init__(self, config: dict) -> None:
        self.hidden = config["hidden_size"]
        self.layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads", self.heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.intermediate = config["intermediate_size"]
        self.vocab = config["vocab_size"]
        self.qkv_bias = config.get("model_type") == "qwen2"
        self.tied = config.get("tie_word_embeddings", False)


class PlainStep:
    """Random weights of ``shape`` and one decode step over them."""

    def __init__(self, shape: Shape, batch: int, context: int, dtype: torch.dtype) -> None:
        self.s, self.batch, self.context = shape, batch, context
        kw = {"dtype": dtype, "device": "cuda"}
        h, d = shape.hidden, shape.head_dim
        qkv_out = (shape.heads + 2 * shape.kv_heads) * d

        def w(*size):
            return torch.randn(*size, **kw) * 0.02

        self.embed = w(shape.vocab, h)
        self.lm_head = self.embed if shape.tied else w(shape.vocab, h)
        self.layers = [{
            "norm1": torch.ones(h, **kw), "norm2": torch.ones(h, **kw),
            "qkv": w(qkv_out, h), "qkv_bias": w(qkv_out) if shape.qkv_bias else None,
            "o": w(h, shape.heads * d), "gate_up": w(2 * shape.intermediate, h),
            "down": w(h, shape.intermediate),
            "k": w(batch, shape.kv_heads, context, d), "v": w(batch, shape.kv_heads, context, d),
        } for _ in range(shape.layers)]
        self.final_norm = torch.ones(h, **kw)
        self.ids = torch.zeros(batch, dtype=torch.int64, device="cuda")
        self.cos = torch.ones(batch, 1, d, **kw)
        self.sin = torch.zeros(batch, 1, d, **kw)

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm] + ([] if self.s.tied else [self.lm_head])
        for layer in self.layers:
            tensors += [t for name, t in layer.items() if t is not None and name not in ("k", "v")]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_bytes(self) -> int:
        return sum(layer[n].numel() * layer[n].element_size()
                   for layer in self.layers for n in ("k", "v"))

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, 1e-6)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-x2, x1), dim=-1) * self.sin

    def __call__(self) -> torch.Tensor:
        s, b = self.s, self.batch
        x = self.embed[self.ids]
        for layer in self.layers:
            y = self._norm(x, layer["norm1"])
            qkv = F.linear(y, layer["qkv"], layer["qkv_bias"])
            q, k, _ = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                                 s.kv_heads * s.head_dim], dim=-1)
            q = self._rope(q.view(b, s.heads, s.head_dim))
            self._rope(k.view(b, s.kv_heads, s.head_dim))  # the cache write is left out
            attn = F.scaled_dot_product_attention(
                q.unsqueeze(2), layer["k"], layer["v"], enable_gqa=s.heads != s.kv_heads)
            x = x + F.linear(attn.reshape(b, -1), layer["o"])
            y = self._norm(x, layer["norm2"])
            gate, up = F.linear(y, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(self._norm(x, self.final_norm), self.lm_head)


def graphed_ms(step: PlainStep, iters: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="checkpoint dir (its config.json)")
    p.add_argument("--label", help="name in the output (default: the directory's)")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=192,
                   help="KV positions per request (a 128-token prompt and half of 128 new)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_graphed_step needs a CUDA GPU")
    torch.manual_seed(0)
    shape = Shape(json.loads((args.model / "config.json").read_text()))
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth_gbs()
    label = args.label or args.model.name
    print(json.dumps({"scenario": "copy_bandwidth", "copy_gb_per_s": round(bandwidth, 1)}),
          flush=True)
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            step = PlainStep(shape, batch, args.context, dtype)
            ms = graphed_ms(step)
            floor_ms = (step.weight_bytes() + step.kv_bytes()) / (bandwidth * 1e9) * 1e3
            print(json.dumps({
                "scenario": "graphed_plain_step", "model": label, "dtype": args.dtype,
                "batch_size": batch, "context": args.context, "ms_per_step": round(ms, 3),
                "tokens_per_s": round(batch / ms * 1e3, 1),
                "weight_gb": round(step.weight_bytes() / 1e9, 3),
                "kv_gb": round(step.kv_bytes() / 1e9, 3),
                "bandwidth_floor_ms": round(floor_ms, 3),
            }), flush=True)
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
