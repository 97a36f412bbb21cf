"""``tool_choice: "required"`` and a named function, enforced with a grammar.

The output is constrained by a JSON schema (the grammar layer compiles it), so whatever the model
writes is a call to a listed function whose arguments validate against that function's schema:

- ``required``: a JSON array of ``{"name": <a listed name>, "parameters": <its arguments>}``
  objects, at least one (exactly one when ``parallel_tool_calls`` is false);
- a named function: the arguments object itself (the name is known).

These outputs are read by ``RequiredCallsFormat`` and ``NamedCallFormat``, which stream like the
model-format parsers (a call's name first, arguments in pieces). A generation cut short by
``max_tokens`` keeps its finished calls; its unfinished rest is content.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.server.openai.tool_parsers.base import Scan, TaggedFormat, ToolCallParser
from radixserve.server.openai.tool_parsers.json_scan import (
    Broken,
    PartialCall,
    decode_value,
    skip_ws,
)
from radixserve.server.openai.tool_parsers.mistral import scan_call_array

# Where a JSON schema keeps the definitions its "$ref"s point at.
_DEFINITION_KEYS = ("$defs", "definitions")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema (a function without ``parameters`` takes none)."""
    return NO_PARAMETERS if parameters is None else parameters


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of ``required`` output for ``functions`` (OpenAI ``function`` objects).

    Definitions of every function move to the root, where their ``$ref`` paths point once the
    parameters are nested in the array; two functions defining one name differently are a
    ``ValueError``. A function whose ``$ref``s point elsewhere in its parameters (``#`` for
    a recursive object, ``#/properties/b``) has its parameters moved to the root's ``$defs``
    too, as ``parameters_of_<name>``, and those refs rewritten to start there: at the
    array's root they would resolve against the array, and its arguments would not validate.
    """
    definitions: dict[str, dict[str, Any]] = {key: {} for key in _DEFINITION_KEYS}
    variants = []
    for function in functions:
        parameters = dict(parameters_schema(function.get("parameters")))
        for key in _DEFINITION_KEYS:
            for name, schema in (parameters.pop(key, None) or {}).items():
                if definitions[key].setdefault(name, schema) != schema:
                    raise ValueError(
                        f"functions {function['name']!r} and another define {key}/{name} "
                        "differently; give the definitions distinct names"
                    )
        home = f"parameters_of_{function['name']}"
        moved = _refs_rebased(parameters, f"#/$defs/{home}")
        if moved != parameters:
            definitions["$defs"][home] = moved
            parameters = {"$ref": f"#/$defs/{home}"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: defs for key, defs in definitions.items() if defs})
    return schema


def _refs_rebased(node: Any, home: str) -> Any:
    """``node`` with each ``$ref`` into itself (``#``, ``#/...`` other than the definitions,
    which move to the root unchanged) rewritten to start at ``home``."""
    if isinstance(node, list):
        return [_refs_rebased(item, home) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _refs_rebased(value, home) for key, value in node.items()}
    ref = node.get("$ref")
    inside = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
    if inside and not ref.startswith(tuple(f"#/{key}/" for key in _DEFINITION_KEYS)):
        out["$ref"] = home + ref[1:]
    return out


def grammar_for(functions: list[dict[str, Any]], named: str | None, parallel: bool) -> str:
    """The ``json_schema`` sampling parameter that enforces the choice."""
    if named is None:
        return json.dumps(required_schema(functions, parallel))
    (function,) = [f for f in functions if f["name"] == named]
    return json.dumps(parameters_schema(function.get("parameters")))


class RequiredCallsFormat(TaggedFormat):
    """The JSON array that ``required`` constrains the output to."""

    markers = ()

    def detect(self, text: str) -> bool:
        return True  # the grammar made the whole output the calls

    def leading_run(self, text: str) -> int | None:
        return 0

    def scan_run(self, text: str, pos: int) -> tuple[list[PartialCall], int | None]:
        return scan_call_array(text, pos, self.tool_names)


class NamedCallFormat(ToolCallParser):
    """The arguments object of the one function a named ``tool_choice`` calls."""

    markers = ()

    def __init__(self, name: str) -> None:
        super().__init__([name])
        self.name = name

    def detect(self, text: str) -> bool:
        return True  # the grammar made the whole output the call

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        start = skip_ws(text, 0)
        try:
            value = decode_value(text, start)
        except Broken:
            scan.add_content(text)
            return scan
        if value is not None and isinstance(value[0], dict):
            end = value[1]
            scan.calls.append(PartialCall(self.name, text[start:end], end))
            scan.add_content(text[end:].strip())
        elif not final:
            scan.calls.append(PartialCall(self.name, text[start:], None))
        else:
            scan.add_content(text)
        return scan
