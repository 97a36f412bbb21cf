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


async def _update(
    tokenizer_manager: TokenizerManager, req: io_struct._Msg
) -> dict[str, str]:
    reply = await tokenizer_manager.control.call(req)  # a refusal is returned, not raised
    tokenizer_manager.request_tokenizer.lora_adapters = dict(reply.loaded_adapters)
    if not reply.success:
        raise ValueError(reply.error_message)
    return dict(reply.loaded_adapters)


async def load_lora_adapter(
    tokenizer_manager: TokenizerManager, lora_name: str, lora_path: str
) -> dict[str, str]:
    """Load the adapter folder ``lora_path`` as ``lora_name``; the adapters loaded after."""
    req = io_struct.LoadLoRAAdapterReqInput(lora_name=lora_name, lora_path=lora_path)
    return await _update(tokenizer_manager, req)


async def unload_lora_adapter(
    tokenizer_manager: TokenizerManager, lora_name: str
) -> dict[str, str]:
    """Unload ``lora_name`` (refused while a request uses it); the adapters loaded after."""
    req = io_struct.UnloadLoRAAdapterReqInput(lora_name=lora_name)
    return await _update(tokenizer_manager, req)


def loaded_adapters(tokenizer_manager: TokenizerManager) -> dict[str, str]:
    return dict(tokenizer_manager.request_tokenizer.lora_adapters)
