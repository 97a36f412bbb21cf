"""radixserve: an LLM serving engine with a radix-tree prefix cache and sessions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.version import __version__

__all__ = ["Engine", "ServerArgs", "__version__"]

if TYPE_CHECKING:
    from radixserve.engine import Engine
    from radixserve.server_args import ServerArgs


def __getattr__(name: str):
    # Lazy: importing the package must not pull torch into every process that only needs structs.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    if name == "ServerArgs":
        from radixserve.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)
