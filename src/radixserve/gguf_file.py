"""GGUF checkpoints (llama.cpp's single-file format): where the file is, and the config it holds.

A GGUF file carries its architecture, hyper-parameters and tokenizer as metadata and its weights
as (often block-quantised) tensors. ``find_gguf`` says whether ``--model-path`` names one (the
file itself, or a directory holding exactly one ``.gguf`` and no ``config.json``);
``gguf_hf_config`` translates the metadata into the ``config.json`` / ``generation_config.json``
dicts ``ModelConfig`` reads, so the rest of the engine sees a GGUF model as any other checkpoint.
``gguf_tensors`` lists the file's tensors from its header (memory-mapped, read when touched),
which ``model_executor/model_loader_gguf.py`` names for our models; their quantisation types are
checked by ``layers/quantization/gguf.py``. Everything here parses with the ``gguf`` package
(ggml's own reader), once per file: what a parse gives is kept in the GGUF cache.

Like ``model_config``, this imports nothing above it and builds no model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.cache_files import source_digest
from radixserve.gguf_cache import cached_json

# GGUF ``general.architecture`` → the architecture name our registry builds. Mistral's GGUF
# files say "llama" (llama.cpp runs them as Llama).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# A "llama" file with experts is Mixtral (llama.cpp runs it as Llama with an MoE FFN).
_MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "llama": "mixtral"}
# Whether the top-k routing weights are renormalised, where the file does not say
# (``{arch}.expert_weights_norm``): llama.cpp's choice per family (Qwen2-MoE: no).
_MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "llama": True}
# What llama.cpp fixes in code for these families rather than storing in the file: Gemma 3's
# sliding layers use RoPE base 10000 and every 6th layer is global; both scale queries by
# head_dim ** -0.5 (Gemma 2 27B, whose query_pre_attn_scalar differs, is not covered).
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_SLIDING_PATTERN = 6
# ``general.file_type`` (llama.cpp's LLAMA_FTYPE) of files whose weights are stored unquantised:
# their float dtype is the checkpoint dtype; quantised files dequantise exactly only to float32.
_FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
_SPLIT_NAME = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def find_gguf(model_path: str | Path) -> Path | None:
    """The GGUF file ``model_path`` names, or None when it is not a GGUF checkpoint.

    A directory is a GGUF checkpoint when it has no ``config.json`` and holds ``.gguf`` files;
    it must hold exactly one. Split GGUF files (``-00001-of-00003.gguf``) are refused.
    """
    path = Path(model_path)
    if path.is_file():
        if path.suffix != ".gguf":
            return None
        found = path
    elif path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if not files:
            return None
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ValueError(
                f"{path} holds several GGUF files ({names}): pass --model-path FILE.gguf"
            )
        found = files[0]
    else:
        return None
    if _SPLIT_NAME.search(found.name):
        raise ValueError(
            f"{found.name} is one part of a split GGUF file, which is not supported; merge the "
            "parts with llama.cpp's `llama-gguf-split --merge` first"
        )
    return found


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (memory-mapped: tensors are read when touched)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


@dataclass(frozen=True)
class GgufTensorEntry:
    """One tensor of a GGUF file: what ``gguf.ReaderTensor`` gives (``name``, ``tensor_type``,
    ``shape`` in ggml's order, innermost first, and ``data``, the file's bytes memory-mapped
    in the reader's array type and shape), without a parse of the file."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


# The element types ``GGUFReader`` reads unquantised tensors as; every other type (quantised,
# BF16) it gives as the rows' bytes.
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


def gguf_tensors(path: str | Path) -> list[GgufTensorEntry]:
    """Every tensor of the file, in the file's order, memory-mapped (read when touched).

    The header's tensor table (names, types, shapes, offsets) is kept in the GGUF cache: the
    ``gguf`` reader parses all the metadata to give it, the tokenizer's strings included, which
    takes 4 s for SmolLM2's 49,152-token vocabulary in every process that loads the weights.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    table = cached_json(Path(path), "tensor-table", gguf_version(),
                        lambda: _read_tensor_table(path))
    file = np.memmap(path, dtype=np.uint8, mode="r")
    out = []
    for name, type_value, dims, offset in table["tensors"]:
        qtype = GGMLQuantizationType(type_value)
        shape = tuple(reversed(dims))  # numpy's order, outermost first
        element = _ELEMENT_TYPES.get(qtype.name)
        if element is None:
            block, type_bytes = GGML_QUANT_SIZES[qtype]
            count = math.prod(dims) // block * type_bytes
            element, shape = np.uint8, quant_shape_to_byte_shape(shape, qtype)
        else:
            count = math.prod(dims) * np.dtype(element).itemsize
        dtype = np.dtype(element).newbyteorder("S" if table["swapped"] else "=")
        data = file[offset:offset + count].view(dtype).reshape(shape)
        out.append(GgufTensorEntry(name, qtype, tuple(dims), data))
    return out


def _read_tensor_table(path: str | Path) -> dict[str, Any]:
    """``gguf_tensors``' table from a parse of the file."""
    reader = open_gguf(path)
    return {
        "swapped": reader.byte_order == "S",  # a file of the other endianness than ours
        "tensors": [[t.name, int(t.tensor_type), [int(n) for n in t.shape.tolist()],
                     int(t.data_offset)] for t in reader.tensors],
    }


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_version(*sources: Path) -> str:
    """The ``version`` of a ``gguf_cache`` entry built by ``sources`` with the ``gguf`` package."""
    from importlib.metadata import version

    return f"gguf {version('gguf')} {source_digest(Path(__file__), *sources)}"


def gguf_hf_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config.json, generation_config.json)`` equivalents of a GGUF file's metadata.

    An architecture we do not build, or a tensor in a quantisation type we cannot dequantise,
    is a ``ValueError`` naming it (checked here, before any process starts). Kept in the GGUF
    cache (``gguf_cache.py``): every process of a start needs it, and parsing takes seconds.
    """
    checks = Path(__file__).parent / "layers" / "quantization" / "gguf.py"
    hf, gen = cached_json(Path(path), "config", gguf_version(checks),
                          lambda: _read_hf_config(path))
    return hf, gen


def _read_hf_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``gguf_hf_config`` from the file itself."""
    from radixserve.layers.quantization.gguf import check_tensor_types

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    check_tensor_types(reader.tensors, path, big_endian=reader.byte_order == "S")
    tensor_names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path} lacks the metadata key {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ValueError(f"{path} gives no vocabulary size ({arch}.vocab_size or tokens)")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path} stores per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling), "
            "which the GGUF loader does not support"
        )
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"GGUF RoPE scaling {scaling_type!r} in {path} is not supported")
    file_type = _field(reader, "general.file_type")
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if arch in ("qwen2moe", "qwen3moe") and not experts:
        raise ValueError(f"{path} lacks the metadata key {arch}.expert_count")
    ffn = _field(reader, f"{arch}.feed_forward_length")
    if ffn is None and experts:  # MoE files may give only the experts' width
        ffn = need("expert_feed_forward_length")
    hf: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "gguf_architecture": arch,
        "hidden_size": hidden,
        "intermediate_size": int(ffn if ffn is not None else need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        # No output.weight: the LM head is the token embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": _FLOAT_FILE_TYPES.get(file_type, "float32"),
    }
    if arch in ("gemma2", "gemma3"):
        hf.update(_gemma_config(reader, arch, need, hf["head_dim"]))
    if arch == "phi3":
        hf.update(_phi3_config(reader, path, hf["head_dim"], tensor_names))
    if experts:
        hf.update(_moe_config(reader, arch, need, experts, tensor_names))
    gen: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            hf[key] = gen[key] = int(value)
    return hf, gen


def _gemma_config(reader: Any, arch: str, need: Any, head_dim: int) -> dict[str, Any]:
    """The ``config.json`` keys of Gemma 2 / Gemma 3 that the GGUF metadata holds or implies."""
    out: dict[str, Any] = {
        "model_type": "gemma2" if arch == "gemma2" else "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(need("attention.sliding_window")),
        "query_pre_attn_scalar": head_dim,
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _field(reader, "gemma2.attn_logit_softcapping")
        out["final_logit_softcapping"] = _field(reader, "gemma2.final_logit_softcapping")
    else:
        out["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_BASE
        out["sliding_window_pattern"] = _GEMMA3_SLIDING_PATTERN
    return out


def _phi3_config(reader: Any, path: str | Path, head_dim: int,
                 tensor_names: set[str]) -> dict[str, Any]:
    """The ``config.json`` keys of a Phi-3 file. Its q/k/v and gate/up projections come fused
    (``attn_qkv``, ``ffn_up``), as in the Hugging Face checkpoint. The 128k-context variants
    carry LongRoPE's per-frequency factors (``rope_factors_long``/``_short``) and Phi-3.5/4-mini
    a partial rotary dimension; neither is supported by the Phi-3 model here, so both are named
    errors rather than a model that would answer wrongly past 4k tokens."""
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & tensor_names:
        raise ValueError(
            f"{path} stores LongRoPE factors (rope_factors_long/short: a 128k-context Phi-3), "
            "which the GGUF loader does not support"
        )
    rotary = _field(reader, "phi3.rope.dimension_count", head_dim)
    if int(rotary) != head_dim:
        raise ValueError(
            f"{path} rotates {rotary} of each head's {head_dim} dimensions (partial rotary), "
            "which the Phi-3 model does not support"
        )
    window = _field(reader, "phi3.attention.sliding_window")
    return {"model_type": "phi3", "sliding_window": int(window) if window else None}


def _moe_config(reader: Any, arch: str, need: Any, experts: int,
                tensor_names: set[str]) -> dict[str, Any]:
    """The ``config.json`` keys of an MoE file (Mixtral, Qwen2-MoE, Qwen3-MoE): expert count,
    top-k, the experts' width, the renormalisation, Qwen2-MoE's shared expert."""
    if arch not in _MOE_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported")
    out: dict[str, Any] = {
        "model_type": _MOE_ARCHITECTURES[arch],
        "num_experts": experts,
        "num_local_experts": experts,
        "num_experts_per_tok": int(need("expert_used_count")),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm",
                                      _MOE_NORM_TOPK[arch])),
    }
    if arch == "llama":
        out["architectures"] = ["MixtralForCausalLM"]
        return out  # Mixtral's experts are intermediate_size wide
    out["moe_intermediate_size"] = int(need("expert_feed_forward_length"))
    if "blk.0.ffn_up_shexp.weight" in tensor_names:
        shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
        if shared is None:  # as llama.cpp: the shared expert's width from its tensor
            up = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_shexp.weight")
            shared = int(up.shape[-1])
        out["shared_expert_intermediate_size"] = int(shared)
    return out
