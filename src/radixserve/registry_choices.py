"""The ``ServerArgs`` fields whose values name an entry of a registry, and their check.

The registries live with what they register: attention backends in ``layers/attention``,
quantisation methods in ``layers/quantization``, tool-call and reasoning parsers in
``server/openai``. ``ServerArgs`` (``server_args.py``) sits below all of them and imports none,
so building one (as the detokenizer does) loads no torch; the names are checked here instead,
against the registries themselves, by whoever starts the processes (the CLI before it builds
``ServerArgs``, ``Engine``, ``launch_server``), so a bad name still fails before any process
is spawned. The CLI also offers these names as its flags' choices.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.layers.attention import ATTENTION_BACKENDS
from radixserve.layers.quantization import QUANTIZATION_METHODS
from radixserve.server.openai.reasoning import REASONING_PARSERS
from radixserve.server.openai.tool_parsers import TOOL_CALL_PARSERS
from radixserve.server_args import ServerArgs

REGISTRY_CHOICES: dict[str, Sequence[str]] = {
    "attention_backend": tuple(ATTENTION_BACKENDS),
    "quantization": tuple(QUANTIZATION_METHODS),
    "tool_call_parser": tuple(TOOL_CALL_PARSERS),
    "reasoning_parser": tuple(REASONING_PARSERS),
}


def check_registry_choices(server_args: ServerArgs) -> ServerArgs:
    """``server_args`` if every registry name it holds is registered, else ``ValueError``
    naming the field and its choices (None: the default, always valid)."""
    for name, choices in REGISTRY_CHOICES.items():
        value = getattr(server_args, name)
        if value is not None and value not in choices:
            raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return server_args
