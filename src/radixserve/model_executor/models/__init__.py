"""Model implementations, reached through the registry (never imported directly by callers)."""

from radixserve.model_executor.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]
