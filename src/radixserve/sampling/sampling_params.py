"""Per-request sampling parameters: parsed from user dicts, validated, sent to the scheduler.

Validation lives here so that every entry point (Engine, native API, OpenAI API) rejects the same
bad input with the same ``ValueError`` message before anything reaches the model.

The keys are SGLang's ``SamplingParams``, and ``from_dict`` reads them as SGLang's server does:
``null`` means the default, an empty grammar string means no grammar. ``n`` is expanded into n
requests by ``GenerateReqInput`` before it gets here. SGLang keys that radixserve does not
implement are refused when they carry a value (``UNSUPPORTED_KEYS``), never dropped.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from radixserve.sampling.stop_regex import validate_stop_regex

_EPS = 1e-6
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Every generated token is checked against every stop string: bound the work one request buys.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 4096
# Bounds that keep float32 logits finite after a bias, a repetition penalty (a divisor of
# positive logits) and a temperature down to _EPS: past them the sampler would see inf and NaN.
MAX_LOGIT_BIAS = 1e30
MIN_REPETITION_PENALTY = 1e-20
# SGLang's sampling keys radixserve does not implement, with the values that mean "unused".
UNSUPPORTED_KEYS: dict[str, tuple[Any, ...]] = {
    "beam_width": (None, 1),
    "custom_params": (None, {}),
    "watermark": (None,),
}


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
    # Stop when the text generated so far contains a match of one of these regexes.
    stop_regex: list[str] = msgspec.field(default_factory=list)
    # Send stream chunks every N tokens (None: the server's --stream-interval).
    stream_interval: int | None = None
    # Constrained decoding: at most one of these (see radixserve.constrained).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; unknown keys, unimplemented keys with a value and wrong types
        raise ``ValueError`` naming the key. ``null`` values mean the default."""
        params = {k: v for k, v in (params or {}).items() if v is not None or k == "sampling_seed"}
        known = set(cls.__struct_fields__) | set(UNSUPPORTED_KEYS) | {"n"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        for key, unused in UNSUPPORTED_KEYS.items():
            if key in params and params.pop(key) not in unused:
                raise ValueError(f"sampling parameter {key} is not supported by radixserve")
        if params.pop("n", 1) != 1:
            raise ValueError("n must be given on the request (GenerateReqInput), not here")
        for key in ("stop", "stop_regex"):
            if isinstance(params.get(key), str):
                params[key] = [params[key]]
        for key in GRAMMAR_FIELDS:
            value = params.get(key)
            if value == "":
                del params[key]  # SGLang: an empty grammar means no grammar
            elif isinstance(value, dict) and key in ("json_schema", "structural_tag"):
                params[key] = json.dumps(value)
        if params.get("logit_bias") is not None:
            try:
                params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError("logit_bias must map token ids to numbers") from e
        try:
            sp = msgspec.convert(params, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid sampling parameters: {e}") from e
        sp.validate()
        return sp

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, spec)`` of the request's grammar (a ``constrained.GrammarKey``), or None."""
        for kind in GRAMMAR_FIELDS:
            spec = getattr(self, kind)
            if spec:
                return kind, spec
        return None

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
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2] and at least {MIN_REPETITION_PENALTY} "
                f"(a smaller divisor overflows float32 logits), got {self.repetition_penalty}"
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
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got "
                             f"{len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters")
        biases = (self.logit_bias or {}).values()
        if not all(abs(v) <= MAX_LOGIT_BIAS for v in biases):  # NaN fails too
            raise ValueError(
                f"logit_bias values must be finite numbers within +-{MAX_LOGIT_BIAS:g} (larger "
                "ones overflow float32 logits once divided by a temperature)"
            )
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        validate_stop_regex(self.stop_regex)  # RE2: linear-time search (stop_regex.py)
        grammars = [k for k in GRAMMAR_FIELDS if getattr(self, k)]
        if len(grammars) > 1:
            raise ValueError(
                f"at most one of {', '.join(GRAMMAR_FIELDS)} may be set, got {', '.join(grammars)}"
            )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids out of vocabulary range: {bad[:10]}")
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids out of vocabulary range: {bad[:10]}")

