"""Model implementations, built through ``radixserve.model_registry`` (never imported directly
by callers)."""
