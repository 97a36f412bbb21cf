"""Which part of an adapter one tensor-parallel rank holds, following its base layer's split.

A column-parallel layer (``q/k/v_proj``, ``gate/up_proj``) keeps whole inputs and a slice of the
outputs on each rank: the adapter's A stays whole and B is cut to the rank's output rows, so the
rank's delta is exactly its slice of the full delta. A row-parallel layer (``o_proj``,
``down_proj``) keeps a slice of the inputs: A is cut to the rank's input columns, B stays whole,
and ``x_rank @ A_rank^T`` is a partial sum of the rank-sized intermediate. The hook sums it over
the group (``LoRADelta``'s ``reduce``: a few floats per row, not the layer's width) before the
expand, and adds the same full delta on every rank to the base layer's all-reduced output. This
is the split SGLang uses for LoRA under tensor parallelism.

KV heads follow ``layers/linear.py``: with fewer KV heads than ranks each rank holds one head,
``tp_rank // (tp_size / num_kv_heads)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.lora.adapter import ModuleShapes

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class RankShards:
    tp_rank: int = 0
    tp_size: int = 1
    num_kv_heads: int = 1  # the model's, all ranks together
    head_dim: int = 1

    def out_rows(self, module: str, out_size: int) -> slice:
        """The rows of ``module``'s B (and of its base layer's output) this rank holds."""
        if module not in COLUMN_PARALLEL or self.tp_size == 1:
            return slice(0, out_size)
        if module in ("k_proj", "v_proj") and self.tp_size >= self.num_kv_heads:
            head = self.tp_rank // (self.tp_size // self.num_kv_heads)
            return slice(head * self.head_dim, (head + 1) * self.head_dim)
        per = out_size // self.tp_size
        return slice(self.tp_rank * per, (self.tp_rank + 1) * per)

    def in_cols(self, module: str, in_size: int) -> slice:
        """The columns of ``module``'s A (its base layer's input features) this rank holds."""
        if module not in ROW_PARALLEL or self.tp_size == 1:
            return slice(0, in_size)
        per = in_size // self.tp_size
        return slice(self.tp_rank * per, (self.tp_rank + 1) * per)

    def local(self, shapes: ModuleShapes) -> ModuleShapes:
        """``shapes`` as this rank's layers see them."""
        out = {}
        for module, (fan_in, fan_out) in shapes.shapes.items():
            cols, rows = self.in_cols(module, fan_in), self.out_rows(module, fan_out)
            out[module] = (cols.stop - cols.start, rows.stop - rows.start)
        return ModuleShapes(shapes.num_layers, out)
