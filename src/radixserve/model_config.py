"""What the engine needs to know about a checkpoint, read from its JSON files alone.

``ModelConfig.from_path`` parses ``config.json`` (both the transformers 4 layout, with top-level
``rope_theta`` and ``rope_scaling``, and the transformers 5 one, with a ``rope_parameters`` dict)
and ``generation_config.json``, checks that safetensors weights are present, and resolves the
dtype the model will run in. A GGUF file's metadata stands in for the JSON files (translated by
``gguf_file.py``). It loads no weights and builds no model, so the tokenizer process can
use it too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.gguf_file import find_gguf, gguf_hf_config
from radixserve.layers.quantization import QuantizationConfig, resolve_quantization
from radixserve.model_registry import (
    SLIDING_WINDOW_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    hidden_act_of,
    is_classifier,
    is_encoder,
    supported_architecture,
)

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; any other name is taken as given."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 instructions (x86 AVX512-BF16/AMX, Arm BF16).

    Without them torch emulates bf16 matmuls, which is slower than float32.
    """
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(
    requested: str, checkpoint_dtype: str | None, device: torch.device, cpu_has_bf16: bool
) -> torch.dtype:
    """The dtype the model runs in.

    An explicit ``requested`` dtype is used as is. ``"auto"`` takes the checkpoint's dtype
    (float32 when it names none), adjusted for CPUs: float16 becomes bfloat16 (CPU fp16 matmuls
    are slow and overflow-prone), and bfloat16 becomes float32 when the CPU lacks bf16 support.
    """
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {requested!r}"
            )
        return _DTYPES[requested]
    name = (checkpoint_dtype or "float32").removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"checkpoint dtype {checkpoint_dtype!r} is not supported; pass dtype=float32, "
            "bfloat16 or float16 explicitly"
        )
    dtype = _DTYPES[name]
    if device.type == "cpu":
        if dtype == torch.float16:
            dtype = torch.bfloat16
        if dtype == torch.bfloat16 and not cpu_has_bf16:
            dtype = torch.float32
    return dtype


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config layout; ``rope_scaling`` is ``None`` for
    plain RoPE, else a dict with ``rope_type`` and the keys that type needs."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5's per-layer-type RoPE (Gemma 3): this is the global layers' one; the
        # model reads the sliding layers' own (``gemma2.local_rope_theta``)
        if "full_attention" not in params:
            raise ValueError("per-layer-type rope_parameters without full_attention")
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {supported}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    missing = [k for k in _REQUIRED_ROPE_KEYS[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **params}


def _check_weights_present(model_dir: Path) -> None:
    if (model_dir / "model.safetensors.index.json").is_file() or any(
        model_dir.glob("*.safetensors")
    ):
        return
    has_bin = any(model_dir.glob("*.bin"))
    raise ValueError(
        f"no safetensors weights in {model_dir}"
        + (" (PyTorch .bin checkpoints are not supported)" if has_bin else "")
    )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and runtime facts of one checkpoint; ``hf_config`` keeps the raw dict."""

    model_path: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    context_len: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    torch_dtype: torch.dtype
    eos_token_ids: list[int]
    bos_token_id: int | None
    tie_word_embeddings: bool
    hf_config: dict[str, Any] = field(repr=False)
    # int8 weights (``layers/quantization``): the checkpoint's scheme or --quantization; None
    # for float weights
    quantization: QuantizationConfig | None = None

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT): it embeds, never generates, and keeps no KV cache."""
        return is_encoder(self.architecture)

    @property
    def is_classifier(self) -> bool:
        """A sequence classifier (cross-encoder): its output is one logit per label."""
        return is_classifier(self.architecture)

    @property
    def labels(self) -> list[str]:
        """A classifier's label names in logit order (``id2label``, else ``LABEL_i`` for each of
        ``num_labels``, transformers' defaults); empty for other models."""
        if not self.is_classifier:
            return []
        id2label = self.hf_config.get("id2label") or {}
        if id2label:
            return [str(id2label[k]) for k in sorted(id2label, key=int)]
        return [f"LABEL_{i}" for i in range(int(self.hf_config.get("num_labels", 2)))]

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def from_path(
        cls,
        model_path: str | Path,
        dtype: str = "auto",
        device: str | torch.device = "cpu",
        context_length: int | None = None,
        quantization: str | None = None,
    ) -> ModelConfig:
        """Parse a local checkpoint directory; every problem is a ``ValueError`` naming it.
        ``quantization``: ``--quantization`` (the checkpoint's own scheme wins)."""
        gguf = find_gguf(model_path)
        if gguf is not None:  # a GGUF file: its metadata stands in for the JSON files
            model_dir = config_file = gguf
            hf, gen = gguf_hf_config(gguf)
        else:
            model_dir = Path(model_path)
            config_file = model_dir / "config.json"
            if not config_file.is_file():
                raise ValueError(
                    f"{config_file} not found: model_path must be a local checkpoint (a "
                    "directory with config.json, or a GGUF file)"
                )
            hf = _read_json(config_file)
            gen_file = model_dir / "generation_config.json"
            gen = _read_json(gen_file) if gen_file.is_file() else {}

        archs = hf.get("architectures") or []
        arch = supported_architecture(archs)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or 'missing'} in {config_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if gguf is None:
            _check_weights_present(model_dir)

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ValueError(f"{config_file} lacks {key!r}")
            return hf[key]

        num_heads = int(need("num_attention_heads"))
        hidden_size = int(need("hidden_size"))
        max_pos = int(need("max_position_embeddings"))
        usable = max_pos  # XLM-R's positions start at pad_token_id + 1
        if arch == "XLMRobertaForSequenceClassification":
            usable -= int(hf.get("pad_token_id", 1)) + 1
        if context_length is not None and context_length > usable:
            raise ValueError(
                f"context_length {context_length} is larger than the model's "
                f"max_position_embeddings {usable}"
            )
        rope_theta, rope_scaling = _rope(hf)
        act = hidden_act_of(arch)
        # Gemma names it hidden_activation (its hidden_act, if any, is ignored by transformers)
        configured = hf.get("hidden_activation") or hf.get("hidden_act", act)
        if configured != act:
            raise ValueError(
                f"hidden_act {configured!r} is not supported for {arch} (only {act})"
            )

        context_len = min(usable, context_length or usable)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if window is not None and window < context_len and arch not in SLIDING_WINDOW_ARCHITECTURES:
            logger.warning(
                "sliding-window attention (window %d) is not implemented: full attention is used, "
                "so outputs past %d tokens differ from the reference",
                window,
                window,
            )

        eos: list[int] = []
        for tid in _token_ids(hf.get("eos_token_id")) + _token_ids(gen.get("eos_token_id")):
            if tid not in eos:
                eos.append(tid)
        bos = hf.get("bos_token_id", gen.get("bos_token_id"))

        resolved_device = resolve_device(device)
        torch_dtype = resolve_dtype(
            dtype,
            hf.get("torch_dtype") or hf.get("dtype"),
            resolved_device,
            cpu_supports_bf16() if resolved_device.type == "cpu" else True,
        )
        return cls(
            model_path=str(model_dir),
            architecture=arch,
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=max_pos,
            context_len=context_len,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            torch_dtype=torch_dtype,
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hf_config=hf,
            quantization=resolve_quantization(quantization, hf),
        )
