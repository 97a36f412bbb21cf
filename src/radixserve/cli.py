"""``radixserve serve``: the command line.

Every ``ServerArgs`` field is a ``--kebab-case`` flag (SGLang's names); booleans are switches and
fields with a fixed set of values list their choices. ``--model-path`` may be left out: the
default model is then used (see ``server/default_model.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixserve import envs, startup_gc
from radixserve.registry_choices import REGISTRY_CHOICES, check_registry_choices
from radixserve.server_args import (
    CPU_KERNEL_AUTOTUNE_MODES,
    DEVICES,
    DTYPES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    KV_CACHE_DTYPE_CHOICES,
    LOAD_BALANCE_METHODS,
    LORA_EVICTION_POLICIES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    ServerArgs,
)
from radixserve.version import __version__

# The secrets, each also read from a file (--NAME-file) or an environment variable.
KEY_FLAGS = {"api_key": envs.RADIXSERVE_API_KEY, "admin_api_key": envs.RADIXSERVE_ADMIN_API_KEY}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

CHOICES: dict[str, Sequence[str]] = {
    "dtype": DTYPES,
    "kv_cache_dtype": KV_CACHE_DTYPE_CHOICES,
    "device": DEVICES,
    "schedule_policy": SCHEDULE_POLICIES,
    "cpu_kernel_autotune": CPU_KERNEL_AUTOTUNE_MODES,
    "load_balance_method": LOAD_BALANCE_METHODS,
    "log_level": LOG_LEVELS,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_storage_backend": HICACHE_STORAGE_BACKENDS,
    "lora_eviction_policy": LORA_EVICTION_POLICIES,
    **REGISTRY_CHOICES,
}

HELP: dict[str, str] = {
    "model_path": "Hugging Face checkpoint directory, or a GGUF file (docs/models.md) "
    "(default: models/radixserve-demo if it exists).",
    "tokenizer_path": "Tokenizer directory (default: the model path).",
    "served_model_name": "Model name in the OpenAI API (default: the model path).",
    "host": "Address to listen on.",
    "port": "Port to listen on.",
    "api_key": "Require 'Authorization: Bearer KEY' on every route except /health.",
    "admin_api_key": "Require this key (instead of --api-key) on the control routes: weights, "
    "memory, profiling, internal state, slow_down, freeze_gc, flush_cache, the dashboard.",
    "dtype": "Weight and activation dtype ('auto': the checkpoint's, fp32 on CPUs without bf16).",
    "device": "Device to run on ('auto': CUDA if available, else CPU).",
    "context_length": "Override the context length (at most the model's).",
    "random_seed": "Seed of the sampling random generators.",
    "tp_size": "Tensor-parallel size: ranks that split every layer (a scheduler process each).",
    "ep_size": "Expert-parallel size of MoE layers, a divisor of --tp-size: each group of "
    "tp_size/ep_size ranks holds 1/ep_size of the experts (docs/scale-out.md).",
    "pp_size": "Pipeline-parallel size: stages that split the layers (a scheduler process per "
    "rank of each stage).",
    "dp_size": "Data-parallel size: model replicas behind one data-parallel controller.",
    "load_balance_method": "How the data-parallel controller picks a replica for a request "
    "(sessions always stay on the replica that holds them).",
    "nnodes": "Machines one replica's ranks run on.",
    "node_rank": "This machine's index among --nnodes (0 runs the HTTP server).",
    "dist_init_addr": "HOST:PORT where rank 0 meets the other ranks (torch.distributed; "
    "default: a free local port, one machine only).",
    "dist_timeout": "Seconds a rank waits for the others in torch.distributed.",
    "quantization": "int8: quantise a float checkpoint's linear layers and LM head to int8 at "
    "load (per output channel, symmetric; half the weight bytes). Checkpoints already "
    "quantised with compressed-tensors W8A16 load as such without it.",
    "is_embedding": "Serve a decoder checkpoint as an embedding model (last-token pooling, "
    "normalised): /encode and /v1/embeddings instead of generation.",
    "kv_cache_dtype": "What the KV cache stores: auto (the model's dtype), bf16, int8 (8-bit "
    "codes with a float32 scale per token and KV head: ~1.9x the tokens of bf16 in the same "
    "memory) or fp8 (fp8_e4m3, fp8_e5m2: 8-bit codes under one scale per layer, as in SGLang "
    "and vLLM: 2x the tokens); less to read per decode step, at a small cost in accuracy "
    "(docs/kv-cache-quantization.md).",
    "quantization_param_path": "A JSON file of fp8 KV-cache scales per layer and "
    "tensor-parallel rank (SGLang's and vLLM's format); they replace the checkpoint's k_scale / "
    "v_scale (docs/kv-cache-quantization.md).",
    "attention_backend": "Attention kernels: torch_native (plain torch, the reference), cpu "
    "(radixserve's CPU kernels; the default on CPU where they take the model's shape) or triton "
    "(Triton paged attention; the default on CUDA; on CPU only under TRITON_INTERPRET=1).",
    "cpu_kernel_autotune": "on: time radixserve's CPU kernels and oneDNN for each linear "
    "shape and batch size once per machine (cached in ~/.cache/radixserve/autotune, a few "
    "seconds at the first start) and run the fastest; off: a static table "
    "(docs/cpu_kernel_dispatch.md).",
    "mem_fraction_static": "Fraction of free memory for the KV cache (default 0.3 on CPU, "
    "0.85 on CUDA).",
    "max_total_tokens": "KV cache size in tokens (overrides --mem-fraction-static).",
    "max_running_requests": "Most requests in the running batch.",
    "page_size": "Tokens per KV cache page.",
    "disable_radix_cache": "Do not reuse prompt prefixes across requests.",
    "enable_hierarchical_cache": "Keep prefixes the KV pool evicts in host memory (and "
    "storage) and load them back instead of recomputing them (docs/hierarchical-cache.md).",
    "hicache_ratio": "Host tier size as a multiple of the device KV pool.",
    "hicache_size": "Host tier size in GB (overrides --hicache-ratio when > 0).",
    "hicache_write_policy": "When KV is copied to the host: write_back (at eviction), "
    "write_through (when cached), write_through_selective (when matched twice).",
    "hicache_storage_backend": "Storage tier below the host: 'file' (needs "
    "--hicache-storage-dir).",
    "hicache_storage_dir": "Directory of the file storage tier; it survives restarts and is "
    "read only by the same model, dtype and KV layout.",
    "max_prefill_tokens": "Token budget of one prefill batch.",
    "chunked_prefill_size": "Longest prefill chunk of one request.",
    "schedule_policy": "Order of waiting requests (lpm: longest cached prefix first).",
    "schedule_conservativeness": "Scale of the decode-token reservation when admitting requests.",
    "enable_priority_scheduling": "Order the waiting queue by each request's priority and let "
    "an important request preempt less important running ones (docs/priority.md).",
    "schedule_low_priority_values_first": "Smaller priority values are more important (default: "
    "larger ones).",
    "priority_scheduling_preemption_threshold": "A waiting request preempts a running one only "
    "when their priorities differ by more than this.",
    "disable_priority_preemption": "Order the waiting queue by priority but never preempt "
    "running requests.",
    "default_priority_value": "Priority of a request that names none (default: the least "
    "important value).",
    "batch_dir": "Folder of the Batch API's files and batches, kept across restarts (unfinished "
    "batches resume); default: a temporary folder removed at shutdown (docs/batch.md).",
    "batch_max_concurrency": "Most requests of all Batch API batches running at once, so that "
    "batches leave room for interactive requests (docs/batch.md).",
    "enable_streaming_session": "Keep a streaming session's KV between turns.",
    "session_store": "Directory of the session store: an idle streaming session's KV is "
    "offloaded to a file there instead of dropped, restored by its next turn, and sessions "
    "survive a restart (open_session with resume).",
    "session_store_max_gb": "Bound of the session store; the least recently used sessions go "
    "first.",
    "session_offload_after": "Offload a streaming session's KV to the store after this many "
    "idle seconds (default: only when the KV pool runs short).",
    "max_sessions": "Most open sessions (per data-parallel replica); opening one more answers "
    "429 until a session closes or times out.",
    "session_idle_timeout": "Seconds after which a session opened without a timeout of its own "
    "is closed when idle (no request running); 0: such sessions stay open until closed.",
    "disable_cuda_graph": "Run decode steps eagerly instead of replaying them from graphs: CUDA "
    "graphs on a GPU, traced TorchScript graphs on a CPU.",
    "cuda_graph_max_bs": "Largest decode batch captured in a CUDA graph or traced into a CPU graph "
    "(default: --max-running-requests); larger batches run eagerly.",
    "enable_overlap_schedule": "Run the model on a thread of its own and plan each decode step "
    "while the previous one computes (same greedy outputs; the default on CUDA).",
    "disable_overlap_schedule": "Keep a CUDA device on the plain schedule (the overlap schedule "
    "is the default on CUDA).",
    "constrained_json_disable_any_whitespace": "JSON-schema output uses the compact separators "
    "', ' and ': ' instead of any whitespace between tokens.",
    "constrained_json_max_whitespace_cnt": "Longest run of whitespace JSON-schema output may "
    "have between tokens (default: unbounded).",
    "enable_deterministic_inference": "Batch-invariant kernels only: a request's greedy (or "
    "seeded) output does not depend on the other requests, the prefill chunk size or the radix "
    "cache (CPU kernels and the cpu attention backend).",
    "speculative_algorithm": "Speculative decoding: NGRAM drafts tokens by prompt lookup over "
    "each request's own prompt and output, STANDALONE with a small draft model; the target "
    "verifies them (greedy output unchanged; docs/speculative.md).",
    "speculative_num_draft_tokens": "NGRAM: draft tokens proposed per request per verify step "
    "(default 8); STANDALONE: speculative_num_steps + 1 (SGLang's count).",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix of a request that must "
    "recur in its tokens for a proposal.",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix matched.",
    "speculative_draft_model_path": "STANDALONE: the draft model (same tokenizer as the "
    "target; the target's own path with --speculative-draft-model-quantization int8 drafts "
    "with its int8 copy).",
    "speculative_draft_model_quantization": "STANDALONE: quantize the draft's weights (int8).",
    "speculative_num_steps": "STANDALONE: draft tokens the draft model decodes per verify step "
    "(default 4).",
    "speculative_eagle_topk": "STANDALONE: drafts per position; 1 (chain drafts) in this build.",
    "speculative_max_batch_size": "Decode batches larger than this run without speculation; "
    "the default is the crossover measured on a 2-core CPU: raise it on bigger machines.",
    "enable_lora": "Serve LoRA adapters on top of the base model (docs/lora.md).",
    "lora_paths": "LoRA adapters to load at start, as NAME=PATH (PEFT adapter folders) or "
    "PATH (named by its path); requests pick one with lora_path or model=BASE:NAME.",
    "max_loras_per_batch": "Adapter slots: a batch mixes at most this many adapters.",
    "max_loaded_loras": "Adapters held in host memory, at least --max-loras-per-batch "
    "(default: that many); a batch's adapters take slots, evicting unused ones.",
    "lora_eviction_policy": "Which unused adapter leaves its slot when a batch needs one: lru "
    "(least recently used) or fifo (longest in a slot).",
    "max_lora_rank": "Largest adapter rank the slots hold (default: the largest of "
    "--lora-paths, 16 without).",
    "lora_target_modules": "Modules adapters may adapt: q_proj k_proj v_proj o_proj gate_proj "
    "up_proj down_proj, or all (default: those of --lora-paths, all without).",
    "stream_interval": "Stream a request's tokens every this many steps (the first and the last "
    "token at once); larger values cost less per token.",
    "enable_metrics": "Serve Prometheus metrics on GET /metrics.",
    "max_queued_requests": "Most generations in flight (a request counts prompts x n, after its "
    "body is parsed): past it 429 with Retry-After; a request that alone asks for more is a "
    "400 (default: 4096).",
    "max_n": "Most samples per prompt (n) one request may ask for (more: 400).",
    "max_batch_size": "Most prompts in one request (/generate, /v1/completions, /encode, "
    "/v1/embeddings; more: 400).",
    "max_top_logprobs_num": "Most top logprobs per position a request may ask for "
    "(top_logprobs_num, top_logprobs, logprobs; more: 400).",
    "max_completion_tokens": "Most tokens one generation may produce: a request without "
    "max_tokens gets at most this many (and no more than its context leaves); one asking for "
    "more is a 400.",
    "chat_template": "Jinja chat template, or a file holding one (default: the tokenizer's).",
    "tool_call_parser": "The tool-call format the model writes (hermes = qwen25 = qwen: "
    "<tool_call>{json}</tool_call>; llama3 = llama3_json: Llama 3.x JSON calls; mistral: "
    "[TOOL_CALLS]): needed for tool_choice 'auto' (default: none; 'required' and named "
    "functions are enforced with a grammar and need no parser).",
    "reasoning_parser": "Separate a thinking model's <think>...</think> into reasoning_content "
    "(qwen3: the model or the template opens the block; deepseek-r1: the output starts in it).",
    "responses_store_size": "Keep at most this many stored /v1/responses responses in memory "
    "(the oldest goes first); GET, DELETE and previous_response_id see only those.",
    "responses_store_ttl": "Forget a stored /v1/responses response this many seconds after it "
    "was stored.",
    "log_requests": "Log every request and HTTP access.",
    "log_level": "Logging level.",
    "skip_warmup": "Skip the warm-up generation before the server reports ready.",
    "watchdog_timeout": "A scheduler step running longer than this many seconds is a hang: "
    "every thread's stack is dumped to the log and the server exits non-zero. Also how long a "
    "control call waits for the scheduler.",
    "health_timeout": "GET /health answers 503 when the scheduler does not answer a liveness "
    "ping within this many seconds.",
    "request_read_timeout": "Seconds a client has to send a request's headers (from opening "
    "the connection or the end of its previous response), and then as many for its body; a "
    "slower client gets 408 and its connection is closed.",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation: str) -> type:
    """The argparse type of a ``ServerArgs`` annotation such as ``'int | None'``."""
    base = annotation.replace(" | None", "").strip()
    if base.startswith("list[") and base.endswith("]"):  # a list flag: nargs="+" of the type
        base = base[len("list["):-1]
    types = {"str": str, "int": int, "float": float}
    if base not in types:
        raise TypeError(f"no command-line type for ServerArgs annotation {annotation!r}")
    return types[base]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServerArgs`` field, with the dataclass default."""
    for f in dataclasses.fields(ServerArgs):
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs: dict[str, Any] = {"dest": f.name, "help": HELP[f.name]}
        if f.type in ("bool", bool):
            kwargs["action"] = "store_true" if not default else argparse.BooleanOptionalAction
            kwargs["default"] = default
        else:
            if str(f.type).startswith("list["):
                kwargs["nargs"] = "+"
            kwargs["type"] = _value_type(str(f.type))
            kwargs["default"] = default
            if f.name in CHOICES:
                kwargs["choices"] = CHOICES[f.name]
            if default is not None:
                kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(_flag(f.name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="radixserve: an LLM serving engine."
    )
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="Start the HTTP server (OpenAI and SGLang-native APIs).",
        description="Start the HTTP server (OpenAI and SGLang-native APIs).",
    )
    add_server_args(serve)
    for name in KEY_FLAGS:
        serve.add_argument(
            _flag(name) + "-file", dest=f"{name}_file", metavar="PATH",
            help=f"Read {_flag(name)} from this file (its first line), so that the key does not "
            f"show in the process list; or set {KEY_FLAGS[name].name}.",
        )
    return parser


def _key(ns: argparse.Namespace, name: str) -> str | None:
    """A key from its flag, its file or its environment variable (in that order)."""
    flag, path = getattr(ns, name), getattr(ns, f"{name}_file")
    if flag is not None and path is not None:
        raise ValueError(f"give {_flag(name)} or {_flag(name)}-file, not both")
    if path is None:
        return flag if flag is not None else KEY_FLAGS[name].get("") or None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{_flag(name)}-file: cannot read {path}: {e.strerror or e}") from e
    if not lines or not lines[0].strip():
        raise ValueError(f"{_flag(name)}-file: {path} holds no key on its first line")
    return lines[0].strip()


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """``ServerArgs`` from parsed flags, resolving the default model when none is given.

    The default model is served under its directory name (``radixserve-demo``)
    unless ``--served-model-name`` says otherwise.
    """
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)}
    values.update({name: _key(ns, name) for name in KEY_FLAGS})
    if values["model_path"] is None:
        from radixserve.server.default_model import default_model_path

        path = default_model_path()
        values["model_path"] = str(path)
        values["served_model_name"] = values["served_model_name"] or path.name
    return check_registry_choices(ServerArgs(**values))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    # Logs (ours and uvicorn's) go to stderr: stdout carries only the server's ready line.
    logging.basicConfig(
        level=ns.log_level.upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        server_args = server_args_from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    from radixserve.server.http_server import launch_server
    from radixserve.server.parent_watch import stop_when_parent_dies

    stop_when_parent_dies()
    try:
        return launch_server(server_args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        # What is left is the interpreter's exit, whose collections would walk the whole heap
        # (seconds on two cores): frozen objects are skipped, atexit handlers still run.
        startup_gc.freeze_and_resume()
