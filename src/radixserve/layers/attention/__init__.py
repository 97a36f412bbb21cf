"""Attention over the paged KV cache: the ``Attention`` layer models use, and its backends.

Callers build backends with ``create_attention_backend``; backend modules are imported on demand.
"""

from __future__ import annotations

import importlib

from radixserve.layers.attention.base_backend import Attention, AttentionBackend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool

__all__ = ["ATTENTION_BACKENDS", "Attention", "AttentionBackend", "create_attention_backend"]

# name → (module under radixserve.layers.attention, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("torch_native_backend", "TorchNativeAttnBackend"),
}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def create_attention_backend(
    name: str, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool
) -> AttentionBackend:
    """Build the backend ``name`` over the given request-slot and KV pools."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )
    module_name, class_name = _BACKENDS[name]
    module = importlib.import_module(f"radixserve.layers.attention.{module_name}")
    return getattr(module, class_name)(req_to_token_pool, token_to_kv_pool)
