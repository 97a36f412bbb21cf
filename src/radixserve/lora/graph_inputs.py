"""The adapter slot of each decode row as an input of the decode graphs: CUDA graphs (SGLang
does the same) and the CPU's traced graphs (``model_executor/cpu_graph_runner.py``).

A captured graph replays fixed kernels on fixed addresses: the eager path's ``LoRABatchInfo``
(groups of rows per adapter, runs of rows, a grid sized by the longest run) is worked out on the
host per step, so it cannot be captured. In a graph the LoRA kernels instead see **one segment
per row** (``LoRABatchInfo.per_row``) over static buffers sized for the largest captured batch:

- ``token_slots[i]``: row ``i``'s adapter slot, -1 for the base model and for padding rows;
- ``seg_starts[i] = i`` (never changes);
- ``seg_lens[i]``: 1 when row ``i`` has an adapter, else 0 (the kernels then skip it, and its
  delta stays the zeros the output starts with).

The grid depends only on the captured batch size, so one graph per size serves every mix of
adapters and the base model. ``write`` copies a batch's per-request slots into the buffers
before a replay, padding to the captured size with -1. The adapter weights stay where the
``LoRAMemoryPool`` keeps them (loading writes the slots in place), so loading and unloading
adapters needs no new capture. On CPU the decode kernel reads copies of them made before the
trace and rewritten in place when the pool changes (``LoRAManager.ready_for_graphs``).
"""

from __future__ import annotations

import torch

from radixserve.layers.lora import LoRABatchInfo

PAD_LORA_SLOT = -1  # padding rows and base-model rows: no adapter


class LoRAGraphInputs:
    def __init__(self, max_bs: int, device: torch.device | str) -> None:
        int64 = {"dtype": torch.int64, "device": device}
        self.max_bs = max_bs
        # The slots and the lengths in one buffer: one host-to-device copy per replay.
        self.rows = torch.zeros((2, max_bs), **int64)
        self.token_slots, self.seg_lens = self.rows[0], self.rows[1]
        self.token_slots.fill_(PAD_LORA_SLOT)
        self.seg_starts = torch.arange(max_bs, **int64)

    def info(self, bs: int, weights_version: int = 0) -> LoRABatchInfo:
        """The LoRA view of a captured batch of ``bs`` rows (the first ``bs`` of each buffer),
        reading the adapter pool at ``weights_version``."""
        return LoRABatchInfo.per_row(self.token_slots[:bs], self.seg_starts[:bs],
                                     self.seg_lens[:bs], weights_version)

    def write(self, lora_slots: list[int] | None, bs: int, padded: int) -> None:
        """Set the first ``padded`` rows for a replay: the ``bs`` requests' slots (``None``:
        all on the base model), then padding rows without an adapter."""
        if not 0 < bs <= padded <= self.max_bs:
            raise ValueError(f"batch of {bs} rows padded to {padded} (captured up to "
                             f"{self.max_bs})")
        host = torch.zeros((2, padded), dtype=torch.int64)
        host[0].fill_(PAD_LORA_SLOT)
        if lora_slots is not None:
            if len(lora_slots) != bs:
                raise ValueError(f"{len(lora_slots)} LoRA slots for a batch of {bs}")
            host[0, :bs] = torch.tensor(lora_slots, dtype=torch.int64)
        host[1] = host[0] >= 0
        self.rows[:, :padded].copy_(host)
