"""The state of one running server that every route reads (``ServerContext``), and how a route
finds it (``get_ctx``). Routers import this module, never the app factory (``app.py``), which
imports them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager
from radixserve.server.errors import APIError
from radixserve.server.metrics import ServerMetrics
from radixserve.server_args import ServerArgs


class ServerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass
class ServerContext:
    """What every route needs: the configuration, the TokenizerManager and the server state."""

    server_args: ServerArgs
    tokenizer_manager: TokenizerManager
    scheduler_info: dict[str, Any]
    metrics: ServerMetrics | None = None
    chat_template: str | None = None
    state: ServerState = ServerState.STARTING
    in_flight: int = 0  # generation requests
    queued_generations: int = 0  # what they were admitted with (``admission.py``)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.server_args.model_name

    @property
    def context_len(self) -> int:
        return int(self.tokenizer_manager.model_config.context_len)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer_manager.model_config.vocab_size)

    @property
    def tokenizer(self) -> Any:
        return self.tokenizer_manager.tokenizer

    def check_model(self, name: str | None) -> None:
        """404 for a ``model`` field naming a model this server does not serve."""
        if name is not None and name not in (self.model_name, self.server_args.model_path):
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )


    def lora_of_model(self, name: str | None) -> str | None:
        """The LoRA adapter a ``model`` field names (SGLang's and vLLM's forms: ``BASE:ADAPTER``
        or the adapter's own name), None for the base model; 404 for anything else."""
        adapters = self.tokenizer_manager.request_tokenizer.lora_adapters
        if name is not None and name not in (self.model_name, self.server_args.model_path):
            base, sep, adapter = name.rpartition(":")
            if sep and base in (self.model_name, self.server_args.model_path) and (
                adapter in adapters
            ):
                return adapter
            if name in adapters:
                return name
        self.check_model(name)
        return None


def get_ctx(request: Request) -> ServerContext:
    """The ``ServerContext`` of the app serving ``request``."""
    return request.app.state.ctx
