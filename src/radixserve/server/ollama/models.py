"""Ollama's model routes: ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``,
``/api/embed``, and the model-management routes this server cannot serve.

The server serves the one model it was started with, so every listing has that model alone,
named as on the OpenAI API (``--served-model-name``, else the model path; a ``:latest`` tag is
accepted too). Its facts come from the checkpoint: the size is that of its weight files, the
parameter count is read from the safetensors headers, the digest is the SHA-256 of its
``config.json``. ``capabilities`` says what the server will do: ``completion`` or
``embedding``, ``tools`` with ``--tool-call-parser``, ``thinking`` with ``--reasoning-parser``.

Pulling, pushing, creating, copying and deleting models are a 501 naming the route: the model
is fixed by ``--model-path`` at start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.server.admission import admit, num_prompts
from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.errors import APIError
from radixserve.server.generations import cancel_on_disconnect
from radixserve.server.off_loop import run_sized
from radixserve.server.ollama.protocol import EmbedRequest, ShowRequest
from radixserve.server.ollama.route import OllamaRoute, check_model

router = APIRouter(route_class=OllamaRoute)

# The Ollama release whose API these routes follow (clients compare it to enable features).
OLLAMA_API_VERSION = "0.12.6"
_NEVER = "9999-12-31T23:59:59Z"  # /api/ps: the model is never unloaded
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DTYPE_NAMES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


@functools.cache
def _checkpoint_facts(model_path: str) -> tuple[int, int | None, str]:
    """(bytes of weight files, parameter count from the safetensors headers or None, digest)."""
    root = Path(model_path)
    files = [p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES] if root.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    params: int | None = 0
    for p in files:
        if p.suffix != ".safetensors":
            params = None
            break
        with p.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, tensor in header.items():
            if name != "__metadata__":
                params += _product(tensor["shape"])
    config = root / "config.json"
    digest = hashlib.sha256(config.read_bytes() if config.is_file() else model_path.encode())
    return size, params if files else None, digest.hexdigest()


def _product(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parameter_size(params: int | None) -> str:
    """Ollama's short form: ``7.6B``, ``135M``."""
    if params is None:
        return "unknown"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.1f}{unit}".replace(".0", "")
    return str(params)


def _details(ctx: ServerContext) -> dict[str, Any]:
    config = ctx.tokenizer_manager.model_config
    family = config.hf_config.get("model_type") or config.architecture
    _, params, _ = _checkpoint_facts(ctx.server_args.model_path)
    quant = config.quantization
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": _parameter_size(params),
        "quantization_level": quant.name if quant else _DTYPE_NAMES.get(str(config.torch_dtype),
                                                                         str(config.torch_dtype)),
    }


def _modified_at(ctx: ServerContext) -> str:
    return datetime.fromtimestamp(ctx.created, UTC).isoformat().replace("+00:00", "Z")


def _entry(ctx: ServerContext) -> dict[str, Any]:
    size, _, digest = _checkpoint_facts(ctx.server_args.model_path)
    return {"name": ctx.model_name, "model": ctx.model_name, "modified_at": _modified_at(ctx),
            "size": size, "digest": digest, "details": _details(ctx)}


def _capabilities(ctx: ServerContext) -> list[str]:
    if not ctx.tokenizer_manager.is_generation:
        return ["embedding"]
    caps = ["completion"]
    if ctx.server_args.tool_call_parser:
        caps.append("tools")
    if ctx.server_args.reasoning_parser:
        caps.append("thinking")
    return caps


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    return {"models": [_entry(get_ctx(request))]}


@router.get("/api/ps")
async def running(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    entry = _entry(ctx)
    on_gpu = ctx.server_args.device not in ("cpu",)
    return {"models": [{**entry, "expires_at": _NEVER, "size_vram": entry["size"] if on_gpu else 0,
                        "context_length": ctx.context_len}]}


@router.post("/api/show")
async def show(body: ShowRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required", param="model")
    check_model(ctx, name)
    config = ctx.tokenizer_manager.model_config
    arch = config.hf_config.get("model_type") or config.architecture
    _, params, _ = _checkpoint_facts(ctx.server_args.model_path)
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None) or ""
    return {
        "modelfile": f"FROM {ctx.server_args.model_path}\n",
        "parameters": "",
        "template": template,
        "details": _details(ctx),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": params,
            f"{arch}.context_length": ctx.context_len,
            f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_hidden_layers,
            f"{arch}.attention.head_count": config.num_attention_heads,
            f"{arch}.attention.head_count_kv": config.num_key_value_heads,
            f"{arch}.vocab_size": config.vocab_size,
        },
        "capabilities": _capabilities(ctx),
        "modified_at": _modified_at(ctx),
    }


@router.post("/api/embed")
async def embed(body: EmbedRequest, request: Request) -> dict[str, Any]:
    """L2-normalised embeddings, as ``/v1/embeddings``; ``truncate`` (Ollama's default) cuts
    an input to the context (``options.num_ctx`` or the model's), else a long input is a 400."""
    started = time.perf_counter_ns()
    ctx = get_ctx(request)
    check_model(ctx, body.model)
    if ctx.tokenizer_manager.model_config.is_classifier:
        raise APIError(400, "this model is a sequence classifier (cross-encoder), not an "
                       "embedding model: use /v1/classify or /v1/rerank")
    admit(request, num_prompts(body.input), prompt_param="input")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise APIError(400, "input must not be an empty list", param="input")
    limit = _embed_limit(ctx, body)
    size = int(ctx.tokenizer_manager.model_config.hidden_size)
    if body.dimensions is not None and body.dimensions != size:
        raise APIError(400, f"dimensions={body.dimensions} is not supported: this model's "
                       f"embeddings have {size} dimensions and cannot be shortened",
                       param="dimensions")
    ids = await run_sized(request, lambda: [ctx.tokenizer.encode(t) for t in texts])
    for i, seq in enumerate(ids):
        if len(seq) > limit and not body.truncate:
            raise APIError(400, f"input {i} has {len(seq)} tokens: more than the context of "
                           f"{limit} (truncate is false)", param="input")
    obj = GenerateReqInput(input_ids=[seq[:limit] for seq in ids])
    outputs = await cancel_on_disconnect(request, ctx.tokenizer_manager.encode_request(obj))
    if isinstance(outputs, dict):
        outputs = [outputs]
    return {
        "model": ctx.model_name,
        "embeddings": [out["embedding"] for out in outputs],
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": sum(out["meta_info"]["prompt_tokens"] for out in outputs),
    }


def _embed_limit(ctx: ServerContext, body: EmbedRequest) -> int:
    """The tokens an input may have: ``options`` may say only ``num_ctx`` here."""
    options = body.options.model_dump(exclude_none=True) if body.options else {}
    num_ctx = options.pop("num_ctx", None)
    if options:
        name = sorted(options)[0]
        raise APIError(400, f"options.{name} does not apply to embeddings",
                       param=f"options.{name}")
    if num_ctx is not None and num_ctx > ctx.context_len:
        raise APIError(400, f"options.num_ctx is {num_ctx}: this model's context length is "
                       f"{ctx.context_len} tokens", param="options.num_ctx")
    return num_ctx or ctx.context_len


def _fixed_model_route(route: str) -> Callable[[], Awaitable[None]]:
    """The handler of a model-management route: the one model is fixed, so each answers 501."""

    async def fixed_model() -> None:
        raise APIError(501, f"{route} is not supported: radixserve serves the one model it was "
                       "started with (--model-path)")

    return fixed_model


for _method, _route in (("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
                        ("POST", "/api/copy"), ("DELETE", "/api/delete")):
    router.add_api_route(_route, _fixed_model_route(_route), methods=[_method])
