"""OpenAI ``response_format`` → the grammar fields of radixserve's sampling parameters.

Every OpenAI-style endpoint that constrains its output (chat, completions, and later tool
calling and the Responses API's ``text.format``) goes through ``grammar_params``, which returns
the ``json_schema`` / ``structural_tag`` entries to merge into a ``SamplingParams`` dict:

    {"type": "text"}                                   → {}
    {"type": "json_object"}                            → {"json_schema": '{"type": "object"}'}
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                       → {"json_schema": <schema as JSON>}
    {"type": "structural_tag", ...}  (SGLang)          → {"structural_tag": <the tag as JSON>}

``json_schema_params(schema)`` is the same for a bare schema (say, a function's parameters).
The scheduler compiles the grammar; an invalid one fails the request with a 400 that carries
xgrammar's message.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ``{"type": "object"}`` compiles to "any JSON object": json_object mode.
ANY_JSON_OBJECT = '{"type": "object"}'


class JsonSchemaFormat(BaseModel):
    """The ``json_schema`` member of ``response_format`` (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    # Constrained decoding always follows the schema exactly; False asks for nothing less.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``, plus SGLang's ``structural_tag`` type."""

    model_config = ConfigDict(extra="allow")  # a structural tag carries its own fields

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _members_match_type(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        if self.type != "structural_tag" and self.model_extra:
            raise ValueError(
                f"unknown response_format field(s): {', '.join(sorted(self.model_extra))}"
            )
        return self


def json_schema_params(schema: dict[str, Any] | bool | str) -> dict[str, str]:
    """Sampling-params fields constraining the output to ``schema`` (a dict or JSON text)."""
    return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}


def grammar_params(response_format: ResponseFormat | None) -> dict[str, str]:
    """Sampling-params grammar fields for ``response_format`` (see the module docstring)."""
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_schema": ANY_JSON_OBJECT}
    if response_format.type == "json_schema":
        assert response_format.json_schema is not None  # checked by the model
        return json_schema_params(response_format.json_schema.schema_)
    tag = {"type": "structural_tag", **(response_format.model_extra or {})}
    return {"structural_tag": json.dumps(tag)}
