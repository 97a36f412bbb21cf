"""Request bodies that never drop a field: unknown fields and unimplemented features get a 400.

Both APIs (OpenAI and SGLang's native one) describe their bodies with ``StrictRequest``
subclasses. A field the API defines but radixserve does not implement is listed in the class's
``UNSUPPORTED`` with the values that mean "not used" (``None``, ``False``, an empty list, ...):
such values are accepted, anything else is refused with a 400 naming the field and saying why
(``server/errors.py`` turns the ``unsupported_parameter`` error into ``param``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

# field name → (values meaning "unused", why a used value is refused)
Unsupported = dict[str, tuple[tuple[Any, ...], str]]


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[Unsupported] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.UNSUPPORTED:
            return data
        data = dict(data)
        for name, (unused, why) in cls.UNSUPPORTED.items():
            if name in data and data.pop(name) not in unused:
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "not supported by radixserve: {why}",
                    {"field": name, "why": why},
                )
        return data


def non_empty_list(value: Any, info: ValidationInfo) -> Any:
    """A field validator for prompts (``field_validator(name)(non_empty_list)``): a list with no
    prompt in it asks for nothing, so it is refused, naming the field, rather than answered
    with an empty reply."""
    if isinstance(value, list) and not value:
        raise ValueError(f"{info.field_name} must not be an empty list")
    return value
