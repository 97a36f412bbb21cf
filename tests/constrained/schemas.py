"""Random JSON schemas for constrained-decoding tests, and checks of what was generated.

Every schema bounds its instances (string lengths, array sizes, integer ranges, nesting), so any
output that follows the grammar completes well within ``MAX_TOKENS`` once whitespace runs are
bounded too (``--constrained-json-max-whitespace-cnt``).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema

MAX_TOKENS = 400
WHITESPACE_CNT = 2  # the servers and schedulers of these tests bound whitespace runs to this

PATTERNS = (r"^[a-z]{1,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^(red|green|blue)$", r"^[A-Z][a-z]{0,4}$")
WORDS = ("alpha", "beta", "gamma", "delta", "x", "long value", "ünï")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A bounded schema: objects, arrays, enums, const, strings (lengths or a pattern),
    bounded integers, booleans, null, anyOf; nested at most two levels."""
    kinds = ["string", "pattern", "integer", "boolean", "enum", "const", "null", "anyOf"]
    if depth < 2:
        kinds += ["object", "object", "array", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "score", "ok", "kind", "meta"], rng.randint(1, 4))
        properties = {n: random_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.7]
        return {"type": "object", "properties": properties, "required": required,
                "additionalProperties": False}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": low, "maxItems": low + rng.randint(0, 2)}
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 5)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "null":
        return {"type": "null"}
    return {"anyOf": [random_schema(rng, 2), random_schema(rng, 2)]}


def random_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


def assert_valid(text: str, schema: dict[str, Any]) -> Any:
    """``text`` is strict JSON (RFC 8259: no raw control characters) matching ``schema``."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


REGEXES = (
    r"[0-9]{2,6}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"(cat|dog|bird)s? (run|sleep)",
)

# An EBNF grammar (xgrammar's GBNF dialect) and a Python regex for the same language.
EBNF = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,6}'
EBNF_LANGUAGE = re.compile(r"(hello|hi) [a-z]{1,6}!")
