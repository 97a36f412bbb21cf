"""Attention over the paged KV cache: the ``Attention`` layer models use, and its backends.

Callers build backends with ``create_attention_backend``; backend modules are imported on demand.

    torch_native  plain torch on any device and dtype: the reference the others are tested
                  against
    cpu           radixserve's CPU kernels (``cpu_backend.py``); the default on CPU where they
                  take the model's KV pool
    triton        paged attention in Triton kernels (``triton_backend.py``); the default on CUDA
                  when triton is installed; on CPU only under ``TRITON_INTERPRET=1`` (tests)
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.attention.base_backend import Attention, AttentionBackend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool

__all__ = [
    "ATTENTION_BACKENDS",
    "Attention",
    "AttentionBackend",
    "create_attention_backend",
    "default_attention_backend",
]

# name → (module under radixserve.layers.attention, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("torch_native_backend", "TorchNativeAttnBackend"),
    "cpu": ("cpu_backend", "CpuAttnBackend"),
    "triton": ("triton_backend", "TritonAttnBackend"),
}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def default_attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``cpu`` on a CPU whose kernels take this KV pool, ``triton`` on CUDA when triton is
    installed, else ``torch_native``."""
    if device.type == "cpu" and cpu_kernels.attention_kernels_support(dtype, head_dim) is None:
        return "cpu"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch_native"


def create_attention_backend(
    name: str,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool: MHATokenToKVPool,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """Build the backend ``name`` over the given request-slot and KV pools; ValueError naming
    the reason when it cannot run on them. ``batch_invariant``: a token's result may not depend
    on its batch, chunk or cache state (``--enable-deterministic-inference``), or ValueError."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )
    module_name, class_name = _BACKENDS[name]
    module = importlib.import_module(f"radixserve.layers.attention.{module_name}")
    return getattr(module, class_name)(req_to_token_pool, token_to_kv_pool, batch_invariant)
