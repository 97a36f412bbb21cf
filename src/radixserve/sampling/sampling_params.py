"""Per-request sampling parameters: parsed from user dicts, validated, sent to the scheduler.

Validation lives here so that every entry point (Engine, native API, OpenAI API) rejects the same
bad input with the same ``ValueError`` message before anything reaches the model.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

_EPS = 1e-6


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; unknown keys and wrong types raise ``ValueError``."""
        params = dict(params or {})
        known = set(cls.__struct_fields__)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        if params.get("stop") is None:
            params.pop("stop", None)
        if params.get("stop_token_ids") is None:
            params.pop("stop_token_ids", None)
        if params.get("logit_bias") is not None:
            try:
                params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError("logit_bias must map token ids to numbers") from e
        params = {k: v for k, v in params.items() if v is not None or k == "sampling_seed"}
        try:
            sp = msgspec.convert(params, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid sampling parameters: {e}") from e
        sp.validate()
        return sp

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` with a message naming the bad field."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(
                f"temperature must be a finite non-negative number, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be non-negative, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be non-negative, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite numbers")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids out of vocabulary range: {bad}")
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids out of vocabulary range: {bad}")
