"""The server process's side of LoRA adapters: the load/unload control calls, and which
adapters requests may name.

The scheduler owns the adapters (``managers/scheduler/lora_requests.py``); each reply carries
the adapters loaded afterwards, which replace the ``RequestTokenizer``'s list so that a request
naming an unknown adapter is refused before it is sent. A refusal (bad folder, no free slot,
an adapter in use) raises ``ValueError`` with the scheduler's reason: a 400 at the HTTP edge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.managers import io_struct

if TYPE_CHECKING:
    from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager


async def _update(tm: TokenizerManager, req: io_struct._Msg) -> dict[str, str]:
    reply = await tm._control(req, io_struct.LoRAUpdateOutput)
    tm.request_tokenizer.lora_adapters = dict(reply.loaded_adapters)
    if not reply.success:
        raise ValueError(reply.error_message)
    return dict(reply.loaded_adapters)


async def load_lora_adapter(tm: TokenizerManager, lora_name: str, lora_path: str) -> dict[
    str, str
]:
    """Load the adapter folder ``lora_path`` as ``lora_name``; the adapters loaded after."""
    return await _update(
        tm, io_struct.LoadLoRAAdapterReqInput(lora_name=lora_name, lora_path=lora_path)
    )


async def unload_lora_adapter(tm: TokenizerManager, lora_name: str) -> dict[str, str]:
    """Unload ``lora_name`` (refused while a request uses it); the adapters loaded after."""
    return await _update(tm, io_struct.UnloadLoRAAdapterReqInput(lora_name=lora_name))


def loaded_adapters(tm: TokenizerManager) -> dict[str, str]:
    return dict(tm.request_tokenizer.lora_adapters)
