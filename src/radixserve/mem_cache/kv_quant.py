"""KV-cache quantization (``--kv-cache-dtype``): which storage dtypes the KV pool takes, and the
rounding of K/V rows into them.

A quantized pool stores each (token, KV head) row of K and of V as ``head_dim`` 8-bit codes and
reads ``row ≈ codes * scale``. Where the scale comes from depends on the dtype, as in the tools
each dtype comes from:

- int8 (llama.cpp's ``q8_0``): a float32 scale per (token, head), ``max|row| / 127``, computed
  as the row is written. int8 needs one: a fixed scale would either clip outliers or spend most
  of its 255 steps on them. It costs 4 bytes per head beside ``head_dim`` bytes of codes (6% at
  head_dim 64), so an int8 pool holds about 1.9x the tokens of a bf16 pool.
- fp8 (SGLang's and vLLM's ``fp8_e4m3`` / ``fp8_e5m2``): one scale per layer for K and one for
  V (``TENSOR_SCALE``, 1.0, what both use when a checkpoint brings no calibrated ``k_scale`` /
  ``v_scale``). A float format keeps its relative precision over a wide range without per-row
  scaling, and nothing is stored per token: an fp8 pool holds exactly 2x the tokens of a bf16
  pool. On SmolLM2 the unit scale costs little against per-token scales (RESULTS.md,
  "KV-cache quantization").

Either way the pool hands the attention backends one ``[slots, head_num]`` float32 scale tensor
for K and one for V per layer: int8's is a buffer beside the codes, indexed by the same slots
(so whatever copies a slot's K/V copies its scales too); fp8's is one float broadcast to that
shape (strides 0, 0), which the kernels read through its strides like any other. Only per-token
scales are part of a slot's bytes (``MHATokenToKVPool.slot_buffers``).

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
# the quantized dtypes whose rows carry a scale of their own (the others: one per layer)
ROW_SCALED_DTYPES: frozenset[torch.dtype] = frozenset({torch.int8})
# the per-layer scale of K and of V in a pool of a dtype without row scales
TENSOR_SCALE = 1.0
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
    """Whether a pool of ``dtype`` stores 8-bit codes (with per-row or per-layer scales)."""
    return dtype in Q_MAX


def has_row_scales(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` stores a scale per (token, head) beside the codes."""
    return dtype in ROW_SCALED_DTYPES


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How logs and errors name a storage dtype (``int8``, ``float8_e4m3fn``, ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` as codes of ``dtype`` and float32 scales ``[...]``: each row
    scaled so that its largest magnitude maps to ``Q_MAX`` (int8: rounded to nearest)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / Q_MAX[dtype]).clamp_min(_MIN_SCALE)
    return quantize_to_scale(x, dtype, scale[..., None]), scale


def quantize_to_scale(x: torch.Tensor, dtype: torch.dtype,
                      scale: float | torch.Tensor) -> torch.Tensor:
    """``x`` as codes of ``dtype`` under ``scale`` (a float, or a tensor broadcast against
    ``x``); magnitudes past ``Q_MAX * scale`` saturate (an fp8 cast would make them NaN)."""
    q_max = Q_MAX[dtype]
    y = (x.float() / scale).clamp(-q_max, q_max)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``codes * scale`` (``scale`` one per row) in ``dtype``."""
    return (codes.float() * scale[..., None]).to(dtype)
