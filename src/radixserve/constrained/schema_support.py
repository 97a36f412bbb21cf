"""JSON-schema keywords that xgrammar accepts but does not enforce, found before compiling.

xgrammar compiles some schemas into a grammar that allows more than the schema: it skips
``not``, ``if``/``then``/``else``, ``contains``, ``uniqueItems``, ``dependentRequired``, a
non-integer ``multipleOf``, ``allOf`` with more than one branch, string formats it does not
know, and a ``pattern`` or ``format`` together with ``minLength``/``maxLength`` (measured with
xgrammar 0.2.8: a grammar with any of these accepted an instance the schema rejects). A request
with such a schema would get output that does not validate, so it is rejected with a 400 that
names the keyword and where it is. ``oneOf`` is enforced as ``anyOf`` (at least one branch
matches), which is exact for the mutually exclusive branches that schema generators emit.

Also refused: a schema no value can match that xgrammar would compile into a grammar admitting
something else (an empty ``anyOf``/``oneOf`` or ``type`` list, a ``required`` property that
``additionalProperties: false`` forbids; xgrammar 0.2.8 produced an empty answer or ``{}`` for
them), and a ``pattern`` that would make decoding slow down without bound (``regex_support.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixserve.constrained.base import GrammarError
from radixserve.constrained.regex_support import check_regex

# Keywords whose constraint the grammar drops.
_UNENFORCED = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas",
)
# String formats xgrammar turns into a grammar (any other value would be ignored).
SUPPORTED_FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer",
    "relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid",
})
# Keywords whose value is one subschema / a list of them / a map of name -> subschema.
_ONE = ("items", "additionalItems", "additionalProperties", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "contains", "not", "if", "then", "else")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_json_schema(schema: Any) -> None:
    """Raise ``GrammarError`` naming the first keyword of ``schema`` that xgrammar would not
    enforce, with its JSON pointer."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {schema!r}")
    for node, pointer in _subschemas(schema, "#"):
        problem = _unenforced(node)
        if problem:
            raise GrammarError(
                f"JSON schema at {pointer}: {problem}, which constrained decoding cannot "
                "enforce (the output could violate the schema)"
            )
        problem = _unsatisfiable(node)
        if problem:
            raise GrammarError(f"JSON schema at {pointer}: {problem}, so no value matches it")
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], f"JSON schema at {pointer}: 'pattern'")


def _unenforced(node: dict[str, Any]) -> str | None:
    found = [k for k in _UNENFORCED if k in node]
    if found:
        return f"keyword {found[0]!r}"
    if node.get("uniqueItems") is True:
        return "keyword 'uniqueItems'"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema"
    multiple = node.get("multipleOf")
    if multiple is not None and (node.get("type") != "integer" or not _is_int(multiple)):
        return "'multipleOf' on a non-integer (only integer multiples of integers are enforced)"
    if _may_be_string(node):
        fmt = node.get("format")
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            return f"string format {fmt!r} (supported: {', '.join(sorted(SUPPORTED_FORMATS))})"
        lengths = "minLength" in node or "maxLength" in node
        if lengths and ("pattern" in node or fmt is not None):
            other = "pattern" if "pattern" in node else "format"
            return f"'{other}' together with 'minLength'/'maxLength'"
    return None


def _unsatisfiable(node: dict[str, Any]) -> str | None:
    for key in ("anyOf", "oneOf", "type"):
        if node.get(key) == []:
            return f"'{key}' is an empty list"
    required = node.get("required")
    if node.get("additionalProperties") is False and isinstance(required, list):
        listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [r for r in required if r not in listed]
        if missing and not node.get("patternProperties"):
            return (f"property {missing[0]!r} is required but 'additionalProperties' is false "
                    "and 'properties' does not list it")
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _may_be_string(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _subschemas(node: Any, pointer: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every subschema of ``node`` (depth first) with its JSON pointer; data keywords such as
    ``enum`` and ``const`` are not walked."""
    if not isinstance(node, dict):
        return
    yield node, pointer
    for key in _ONE:
        yield from _subschemas(node.get(key), f"{pointer}/{key}")
    for key in _LIST:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")
    for key in _MAP:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                escaped = str(name).replace("~", "~0").replace("/", "~1")
                yield from _subschemas(child, f"{pointer}/{key}/{escaped}")
