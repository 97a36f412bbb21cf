"""The sampling fields that the Ollama ``options`` and the Responses API body both take.

Both are plain optional values passed on to SGLang's sampling parameters under these names
(``None``: radixserve's default), so the two request models declare them once, here, and add
their own fields (each API's ``temperature`` range, Ollama's ``seed``, the Responses API's
``repetition_penalty``, ...).
"""

from __future__ import annotations

from radixserve.server.strict_request import StrictRequest


class SamplingFields(StrictRequest):
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
