"""KV-cache quantization (``--kv-cache-dtype``): which storage dtypes the KV pool takes, and the
rounding of K/V rows into them.

A quantized pool stores each (token, KV head) row of K and of V as ``head_dim`` 8-bit codes plus
one float32 scale (symmetric, per token and head: ``row ≈ codes * scale`` with
``scale = max|row| / Q_MAX``). Per-token scales need no calibration and adapt to every row as it is
written; they cost 4 bytes per head next to ``head_dim`` bytes of codes (6% at head_dim 64), so
the pool holds about 1.9x the tokens of a bf16 pool in the same memory. The scales live in the
pool beside the codes (``MHATokenToKVPool.k_scale_buffer`` / ``v_scale_buffer``), indexed by the
same slots, so whatever copies a slot's K/V copies its scales too.

The attention backends read codes and scales and dequantize in their kernels (cpu, triton) or
after their gather (torch_native); each refuses at start-up a storage dtype it cannot read.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype value → storage dtype (None: the model's dtype). SGLang's names, with the
# aliases vLLM accepts ("bfloat16", "fp8" = e4m3).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

# the largest magnitude each quantized storage dtype holds (the codes span [-Q_MAX, Q_MAX])
Q_MAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}
QUANTIZED_DTYPES: tuple[torch.dtype, ...] = tuple(Q_MAX)
SCALE_DTYPE = torch.float32
# smallest scale: an all-zero row gets codes 0 with a finite scale, never 0/0
_MIN_SCALE = 1e-12


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool stores for ``--kv-cache-dtype`` under a model of ``model_dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` stores codes with per-row scales."""
    return dtype in Q_MAX


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How logs and errors name a storage dtype (``int8``, ``float8_e4m3fn``, ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` as codes of ``dtype`` and float32 scales ``[...]``: each row
    scaled so that its largest magnitude maps to ``Q_MAX`` (int8: rounded to nearest)."""
    q_max = Q_MAX[dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / q_max).clamp_min(_MIN_SCALE)
    y = (x / scale[..., None]).clamp(-q_max, q_max)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``codes * scale`` (``scale`` one per row) in ``dtype``."""
    return (codes.float() * scale[..., None]).to(dtype)
