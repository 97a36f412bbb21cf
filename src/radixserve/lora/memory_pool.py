"""Where loaded adapters' weights live: a fixed number of slots per adapted linear layer.

For each decoder layer and each fused module with an adapted shard (``qkv_proj``: q, k, v;
``o_proj``; ``gate_up_proj``: gate, up; ``down_proj``) the pool holds

    a  [slots, shards * R, in]     shard i's A in rows [i*R, i*R + r)
    b  [slots, out, shards * R]    shard i's B (scaled) in its output rows, columns [i*R, i*R + r)

in float32 on CPU (the model's dtype elsewhere), ``R = --max-lora-rank``,
``slots = --max-loras-per-batch``. B is block-diagonal, so ``b @ (a @ x)`` gives each shard's
delta in its own output rows and one ``LoRADelta`` serves a fused layer; unused ranks and
shards stay zero and add nothing. Under tensor parallelism each rank holds its part
(``tp_shards.py``): B's rows of a column-parallel layer, A's columns of a row-parallel one.
The pool is allocated once at start-up, so adapter memory is fixed and counted (``nbytes``)
whatever is loaded; loading writes a slot, unloading zeroes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.lora.adapter import LORA_TARGET_MODULES, LoRAAdapter, ModuleShapes
from radixserve.lora.tp_shards import RankShards

# Our fused module → its Hugging Face shards, in output order.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LayerBuffers:
    """One adapted linear layer's stacked weights (see the module docstring)."""

    a: torch.Tensor
    b: torch.Tensor
    shards: tuple[str, ...]
    out_offsets: dict[str, tuple[int, int]]  # shard → (first output row, rows)
    # int64 [n, 4] on the host: (first rank, end rank, first output, end output) of each shard
    # that adapters may target: B is zero outside these blocks (the CPU kernel skips the rest)
    blocks: torch.Tensor | None = None


class LoRAMemoryPool:
    def __init__(
        self,
        shapes: ModuleShapes,
        layers: range,
        slots: int,
        max_rank: int,
        target_modules: tuple[str, ...],
        device: torch.device,
        dtype: torch.dtype,
        shards: RankShards | None = None,
    ) -> None:
        """``layers``: the decoder layers this rank holds (its pipeline stage's); ``shards``:
        this rank's part of each module under tensor parallelism (``tp_shards.py``)."""
        self.slots, self.max_rank = slots, max_rank
        self.shards = shards or RankShards()
        full_shapes, shapes = shapes, self.shards.local(shapes)
        self.full_shapes = full_shapes
        self.buffers: dict[tuple[int, str], LayerBuffers] = {}
        # Bumped whenever a slot's weights change: copies of them (the CPU op's stacked
        # weights, ``layers/lora/lora_op.py``) are rebuilt under a new version.
        self.version = 0
        for fused, shards in FUSED_SHARDS.items():
            if not any(s in target_modules for s in shards):
                continue
            fan_in = shapes.shapes[shards[0]][0]
            offsets, row = {}, 0
            for shard in shards:
                rows = shapes.shapes[shard][1]
                offsets[shard] = (row, rows)
                row += rows
            width = len(shards) * max_rank
            blocks = torch.tensor(
                [[i * max_rank, (i + 1) * max_rank, offsets[shard][0], sum(offsets[shard])]
                 for i, shard in enumerate(shards) if shard in target_modules],
                dtype=torch.int64,
            ).reshape(-1, 4)
            for layer in layers:
                self.buffers[(layer, fused)] = LayerBuffers(
                    torch.zeros(slots, width, fan_in, device=device, dtype=dtype),
                    torch.zeros(slots, row, width, device=device, dtype=dtype),
                    shards,
                    offsets,
                    blocks,
                )

    def nbytes(self) -> int:
        return sum(buf.a.nbytes + buf.b.nbytes for buf in self.buffers.values())

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Place ``adapter``'s weights in ``slot`` (the slot's old content is zeroed first)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            fused = LORA_TARGET_MODULES[module][0]
            buf = self.buffers.get((layer, fused))
            if buf is None:  # a layer of another pipeline stage
                continue
            i = buf.shards.index(module)
            first, rows = buf.out_offsets[module]
            cols = slice(i * self.max_rank, i * self.max_rank + adapter.rank)
            fan_in, fan_out = self.full_shapes.shapes[module]
            a = a[:, self.shards.in_cols(module, fan_in)]
            b = b[self.shards.out_rows(module, fan_out)]
            buf.a[slot, cols] = a.to(buf.a.dtype)
            buf.b[slot, first : first + rows, cols] = b.to(buf.b.dtype)

    def clear(self, slot: int) -> None:
        self.version += 1
        for buf in self.buffers.values():
            buf.a[slot].zero_()
            buf.b[slot].zero_()
