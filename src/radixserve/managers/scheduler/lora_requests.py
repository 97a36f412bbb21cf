"""The scheduler's side of LoRA: binding each request to its adapter, and the load/unload
control requests.

A request names its adapter (``lora_path``); intake looks it up in the runner's
``LoRAManager`` and stores the adapter's name and cache namespace on the ``Req`` (an unknown
name, e.g. one unloaded since the server's check, is a 400). The prefill planner admits a
request only while the batch's distinct adapters fit ``--max-loras-per-batch``
(``adapter_fits``) and gives the batch's adapters pool slots (``assign_slots``). Unloading an
adapter that a running or waiting request uses is **refused** (the reply names how many requests
use it); the caller retries once they finish. Loading is refused when ``--max-loaded-loras``
adapters are loaded.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixserve.lora import LoRAAdapterError
from radixserve.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
)
from radixserve.managers.scheduler.schedule_batch import live_reqs

if TYPE_CHECKING:
    from radixserve.lora.lora_manager import LoRAManager
    from radixserve.managers.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)


def bind_lora(req: Req, lora_path: str | None, manager: LoRAManager | None) -> str | None:
    """Set ``req``'s adapter slot and namespace; the reason it cannot run, or None."""
    if lora_path is None:
        return None
    if manager is None:
        return "lora_path needs a server started with --enable-lora"
    entry = manager.loaded.get(lora_path)
    if entry is None:
        return f"no LoRA adapter named {lora_path!r} is loaded"
    req.lora_path, req.lora_namespace = lora_path, entry.namespace
    return None


def adapter_fits(req: Req, adapters: set[str], max_loras_per_batch: int) -> bool:
    """Whether admitting ``req`` keeps the batch's distinct adapters (``adapters``: those of
    the running and already admitted requests) within ``--max-loras-per-batch``."""
    return (req.lora_path is None or req.lora_path in adapters
            or len(adapters) < max_loras_per_batch)


def assign_slots(manager: LoRAManager, reqs: list[Req]) -> None:
    """Give the adapters of ``reqs`` (a batch about to run, with the requests still running)
    pool slots, and each request its adapter's slot (-1: the base model)."""
    slots = manager.ensure_slots({r.lora_path for r in reqs if r.lora_path is not None})
    for req in reqs:
        req.lora_slot = -1 if req.lora_path is None else slots[req.lora_path]


class LoRAControl:
    """Handlers of ``LoadLoRAAdapterReqInput`` and ``UnloadLoRAAdapterReqInput``."""

    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager

    def handlers(self) -> list[tuple[type, Any]]:
        return [
            (LoadLoRAAdapterReqInput, self.load),
            (UnloadLoRAAdapterReqInput, self.unload),
        ]

    def _reply(self, error: str = "") -> LoRAUpdateOutput:
        loaded = {} if self.manager is None else {
            name: e.adapter.path for name, e in self.manager.loaded.items()
        }
        return LoRAUpdateOutput(success=not error, error_message=error, loaded_adapters=loaded)

    def load(self, msg: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        if self.manager is None:
            return self._reply("LoRA is not enabled: start the server with --enable-lora")
        try:
            entry = self.manager.load(msg.lora_name, msg.lora_path)
        except (LoRAAdapterError, OSError) as e:
            logger.warning("LoRA adapter %s refused: %s", msg.lora_name, e)
            return self._reply(str(e))
        logger.info("LoRA adapter %s (rank %d) loaded from %s, slot %s", msg.lora_name,
                    entry.adapter.rank, msg.lora_path, self.manager.slot_of.get(msg.lora_name))
        return self._reply()

    def unload(self, msg: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        if self.manager is None:
            return self._reply("LoRA is not enabled: start the server with --enable-lora")
        users = sum(
            1 for r in live_reqs() if r.lora_path == msg.lora_name and r.finished_reason is None
        )
        if users:
            return self._reply(
                f"LoRA adapter {msg.lora_name!r} is in use by {users} running or waiting "
                "request(s); unload it once they finish"
            )
        try:
            self.manager.unload(msg.lora_name)
        except LoRAAdapterError as e:
            return self._reply(str(e))
        logger.info("LoRA adapter %s unloaded", msg.lora_name)
        return self._reply()
