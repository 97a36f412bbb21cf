"""Why a request ended: one tagged union from the scheduler to the edges (docs/architecture.md §1).

The scheduler sets a request's reason, the detokenizer and the TokenizerManager pass it on as it
is (it crosses the processes inside ``io_struct`` messages), and only the edges turn it into
SGLang's dict (``to_dict``: the ``meta_info["finish_reason"]`` of ``/generate`` and the
``Engine``), which the OpenAI routes map to their own ``finish_reason``::

    FinishStop(matched=2)                     {"type": "stop", "matched": 2}
    FinishStop(matched="###")                 {"type": "stop", "matched": "###"}
    FinishLength(length=16)                   {"type": "length", "length": 16}
    FinishAbort(message="...")                {"type": "abort", "message": "..."}
    FinishAbort(message="...", status_code=400)
                                 {"type": "abort", "message": "...", "status_code": 400}

An abort's ``status_code`` says the request was refused or failed rather than cancelled: 400 bad
input, 500 a scheduler error, 503 memory released; the TokenizerManager raises for those.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class _Reason(msgspec.Struct, tag_field="type", kw_only=True, frozen=True, omit_defaults=True):
    @property
    def kind(self) -> str:
        """``"stop"``, ``"length"`` or ``"abort"``: the dict's ``type``."""
        return self.__struct_config__.tag

    def to_dict(self) -> dict[str, Any]:
        """SGLang's shape: ``{"type": ..., <fields>}``; an unset ``status_code`` is left out."""
        return msgspec.to_builtins(self)


class FinishStop(_Reason, tag="stop"):
    """EOS, a stop token, a stop string or ``stop_regex`` pattern, or a completed grammar."""

    matched: int | str  # the token id, or the stop string / pattern that matched


class FinishLength(_Reason, tag="length"):
    """``max_new_tokens`` reached (0 for prefill-only requests and embeddings)."""

    length: int


class FinishAbort(_Reason, tag="abort"):
    """Cancelled (client gone, ``abort_request``), refused, or failed; see the module."""

    message: str
    status_code: int | None = None


FinishReason = Union[FinishStop, FinishLength, FinishAbort]  # noqa: UP007 - msgspec needs a Union
