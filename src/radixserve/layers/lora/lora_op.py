"""The batched LoRA op: each row of a batch gets the delta of its own adapter, or none.

For a linear layer with stacked adapter weights ``a [slots, R, in]`` and ``b [slots, out, R]``
(one slot per loaded adapter, ranks zero-padded to ``R = --max-lora-rank``, scaling folded into
``b``), row ``t`` with adapter slot ``s = token_slots[t]`` gets ``b[s] @ (a[s] @ x[t])``; a row
with slot -1 (the base model) gets zeros. A fused layer (``qkv_proj``, ``gate_up_proj``) stacks
its shards' A along the rank axis and places each shard's B block-diagonally, so one op serves
it (``lora/memory_pool.py`` lays them out).

``forward_native`` is the reference (a per-row gather of the weights, one einsum);
``forward_cuda`` runs two Triton kernels over runs of rows of one adapter (``triton_lora.py``);
``forward_cpu`` groups the rows by adapter (``LoRABatchInfo``, computed once per step for all
layers): rows of one adapter take two dense matmuls; rows of several take two matmuls against
the A and B of the adapters present side by side, each row masked to its own adapter's block
(a few large ops instead of a pair per adapter: on CPU a small step's cost is mostly per op).
The cost follows the adapters present, not the slots. They agree up to float rounding order.

The weights may be held in another dtype than ``x`` (float32 on CPU, where torch's small bf16
matmuls are several times slower than float32 ones): ``x`` is cast to the weights' dtype and
the delta back to ``x``'s. ``add_to`` (the layers' hooks) keeps bf16 copies of them for a bf16
model, which its decode kernel and its bf16 prefills read; a float32 model stays in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import CustomOp, OpImpl

# Rows up to which the CPU path treats a batch as a decode step: one fused kernel per layer
# (``add_to``), or the masked two-matmul form; above it (prefills) each adapter's rows take
# their own two matmuls, whose cost is then the arithmetic, not the number of ops.
SMALL_BATCH_ROWS = 64
# A bf16 prefill takes one matmul pair per run of consecutive rows of one adapter (a request's
# tokens: slices, no gather or scatter) while its runs average at least this many rows; else one
# pair per adapter over its gathered rows. The expand skips a fused layer's zero blocks of B
# when every block is at least ``WIDE_BLOCK_COLS`` wide (gate_up); narrower blocks (qkv's k and
# v) cost more as separate ops than their zeros do as arithmetic.
RUN_ROWS = 16
WIDE_BLOCK_COLS = 1024
# Output columns per chunk of the decode kernel's copy of B (``csrc/lora.cpp``'s kChunk).
LORA_CHUNK = 64


@dataclass
class LoRABatchInfo:
    """Which adapter each row of this step's batch uses, built once per step.

    ``token_slots``: ``[num_tokens]`` int64, the adapter slot of each row, -1 for the base model.
    ``groups``: per adapter slot present, the rows using it: a ``slice`` when they are
    contiguous (one request, or neighbours), else an index tensor."""

    token_slots: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]]
    # Rows of several adapters: the slots present, and per weight width W the [rows, P*W]
    # 0/1 mask that keeps each row's own adapter's block (built on first use, per step).
    present: torch.Tensor | None = None
    # Runs of consecutive rows of one adapter (the Triton kernels' unit of work): first row,
    # length and slot of each, on the device, and the longest run's length.
    seg_starts: torch.Tensor | None = None
    seg_lens: torch.Tensor | None = None
    seg_slots: torch.Tensor | None = None
    max_seg_len: int = 0
    # A CUDA graph's decode step (``lora/graph_inputs.py``): one segment per row over static
    # buffers whose values change between replays (length 0 for base-model and padding rows),
    # so nothing here may be read on the host; ``groups`` is empty.
    static: bool = False
    # The slots present on the host, and the version of the pool's weights this step reads:
    # the CPU path keeps the present adapters' weights stacked across steps under these.
    present_slots: tuple[int, ...] = ()
    weights_version: int = 0
    # The same runs on the host, ``(start, length, slot)`` each (a bf16 prefill's unit).
    runs: tuple[tuple[int, int, int], ...] = ()
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (width, dtype)
        if key not in self._masks:
            assert self.present is not None
            own = self.token_slots.unsqueeze(1) == self.present.unsqueeze(0)  # [rows, P]
            self._masks[key] = own.to(dtype).repeat_interleave(width, dim=1)
        return self._masks[key]

    @classmethod
    def from_token_slots(
        cls, token_slots: torch.Tensor, device: torch.device | str | None = None,
        weights_version: int = 0,
    ) -> LoRABatchInfo:
        """``token_slots`` on the host (read here without a device synchronisation), moved to
        ``device`` (default: where they are) for the kernels; ``weights_version``: the pool's
        (``LoRAMemoryPool.version``), which changes whenever a slot's weights do."""
        slots_cpu = token_slots.tolist()
        token_slots = token_slots.to(device) if device is not None else token_slots
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(slots_cpu):
            if slot >= 0:
                rows.setdefault(slot, []).append(i)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, idx in rows.items():
            if idx[-1] - idx[0] + 1 == len(idx):
                groups.append((slot, slice(idx[0], idx[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(idx, dtype=torch.int64,
                                                  device=token_slots.device)))
        present = None
        if len(groups) > 1:
            present = torch.tensor([slot for slot, _ in groups], dtype=torch.int64,
                                   device=token_slots.device)
        runs: list[list[int]] = []  # [start, length, slot]
        for i, slot in enumerate(slots_cpu):
            if slot < 0:
                continue
            if runs and runs[-1][2] == slot and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1, slot])
        seg = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3).T.contiguous()
        seg = seg.to(token_slots.device)
        return cls(token_slots, groups, present, seg[0], seg[1], seg[2],
                   max((run[1] for run in runs), default=0),
                   present_slots=tuple(slot for slot, _ in groups),
                   weights_version=weights_version,
                   runs=tuple((start, length, slot) for start, length, slot in runs))

    @classmethod
    def per_row(cls, token_slots: torch.Tensor, seg_starts: torch.Tensor,
                seg_lens: torch.Tensor, weights_version: int = 0) -> LoRABatchInfo:
        """One segment per row (a decode step, one token a row): row ``i`` is segment ``i``
        of slot ``token_slots[i]`` and length ``seg_lens[i]`` (1 with an adapter, else 0).
        The kernels' grid then depends on the number of rows only, not on which adapters
        they use, so a captured or traced graph replays for any mix."""
        return cls(token_slots, [], None, seg_starts, seg_lens, token_slots, 1, static=True,
                   weights_version=weights_version)

    @property
    def any_adapter(self) -> bool:
        return self.static or bool(self.groups)


# Sums the rank-sized intermediate over the tensor-parallel group (row-parallel layers).
Reduce = Callable[[torch.Tensor], torch.Tensor]


class LoRADelta(CustomOp):
    """``delta[t] = b[s_t] @ a[s_t] @ x[t]`` for rows with an adapter, 0 for the others.

    ``reduce``, when given, is applied to ``a[s_t] @ x[t]`` before the expand: a row-parallel
    layer's rank holds a slice of A's columns, so that product is a partial sum
    (``lora/tp_shards.py``)."""

    cpu_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    cpu_ops = ("lora_add_",)

    def __init__(self) -> None:
        super().__init__()
        # CPU, rows of several adapters: per layer (its ``a``), the A of the adapters present
        # stacked ``[P*W, in]`` and their B side by side, transposed ``[P*W, out]``, kept while
        # the same adapters are present and their weights unchanged (a decode step's adapters
        # are usually the last step's): gathering them took more time than the matmuls. At
        # most one stacked copy of each layer's present adapters, so at most the pool's size.
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._stacked_for: tuple[tuple[int, ...], int] | None = None
        # CPU kernel and bf16 prefills: per layer (its ``a``) and layout, A and B transposed in
        # the activations' dtype, per pool version (``_kernel_weights``; a bf16 model that
        # decodes and prefills holds B twice, in bf16: the pool's float32 size again at most).
        # Each entry: (a, the copy, how to make it again from the pool).
        self._bt: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor,
                                              Callable[[], torch.Tensor]]] = {}
        self._bt_version: int | None = None

    def add_to(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        info: LoRABatchInfo, reduce: Reduce | None = None, blocks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out += delta`` in place (what the layers' hooks do). On CPU a decode-sized batch
        in bf16 or float32 takes one kernel (``cpu_kernels.lora_add_``), which adds the delta
        in float32 and rounds once, where ``out.add_(delta)`` rounds the delta first; so does
        a graph's decode step (``info.static``: the kernel reads the rows' slots from the
        graph's buffer, whatever the batch size). Larger bf16 batches (prefills) take
        ``_add_bf16``; float32 ones ``_add_groups``.
        ``blocks`` (int64 ``[n, 4]``, ``LayerBuffers.blocks``): the rank and output ranges
        outside which ``b`` is zero; None: all of it."""
        on_cpu = self.impl is OpImpl.CPU and reduce is None
        if (on_cpu and (info.static or x.shape[0] <= SMALL_BATCH_ROWS)
                and self._kernel_fits(out.dtype, a) and out.dtype == x.dtype
                and out.is_contiguous()):
            blocks = self._all_of(a, b) if blocks is None else blocks
            a_k, bt_k = self._kernel_weights(a, b, info.weights_version, out.dtype, blocks)
            cpu_kernels.lora_add_(out, x.contiguous(), a_k, bt_k, info.token_slots, blocks)
            return out
        if (on_cpu and not info.static and x.shape[0] > SMALL_BATCH_ROWS
                and out.dtype == x.dtype == torch.bfloat16 and a.dtype == torch.float32):
            a_k, bt_k = self._kernel_weights(a, b, info.weights_version, out.dtype)
            return self._add_bf16(out, x, a_k, bt_k, info, blocks)
        if (on_cpu and not info.static
                and not (info.present is not None and x.shape[0] <= SMALL_BATCH_ROWS)):
            return self._add_groups(out, x, a, b, info)
        return out.add_(self(x, a, b, info, reduce))

    @staticmethod
    def _kernel_fits(dtype: torch.dtype, a: torch.Tensor) -> bool:
        """Whether the decode kernel serves activations of ``dtype`` over the pool's ``a``."""
        return dtype in (torch.float32, torch.bfloat16) and a.dtype == torch.float32

    def kernel_copies(self, a: torch.Tensor, b: torch.Tensor, blocks: torch.Tensor | None,
                      version: int, dtype: torch.dtype) -> None:
        """Make, or bring up to pool ``version`` in place, the decode kernel's copies of one
        layer's weights for activations of ``dtype``. Before a CPU graph is traced (a trace
        records them as constants: made inside it, their making would be recorded and redone
        at every replay) and before each replay (the graph reads the tensors it recorded)."""
        if self.impl is OpImpl.CPU and self._kernel_fits(dtype, a):
            blocks = self._all_of(a, b) if blocks is None else blocks
            self._kernel_weights(a, b, version, dtype, blocks)

    @staticmethod
    def _all_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The one block of a layer whose ``b`` has no zero blocks: every rank, every column."""
        return torch.tensor([[0, a.shape[1], 0, b.shape[1]]], dtype=torch.int64)

    @staticmethod
    def _add_groups(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    info: LoRABatchInfo) -> torch.Tensor:
        """``out[rows] += (x[rows] A^T) B^T`` per adapter's rows, in place, each delta computed
        in the weights' dtype and rounded to ``out``'s once; rows of no adapter are not touched.
        ``add_to`` calls it on the layer's output (a prefill then needs no zero-filled buffer of
        the whole batch, cast back and added: on a 1,024-row prefill of a 0.5B model those were
        most of LoRA's extra cost); ``forward_cpu`` on zeros."""
        for slot, rows in info.groups:
            if isinstance(rows, slice):
                out[rows] += ((x[rows].to(a.dtype) @ a[slot].T) @ b[slot].T).to(out.dtype)
            else:
                delta = (x.index_select(0, rows).to(a.dtype) @ a[slot].T) @ b[slot].T
                out.index_add_(0, rows, delta.to(out.dtype))
        return out

    @staticmethod
    def _add_bf16(out: torch.Tensor, x: torch.Tensor, a_k: torch.Tensor, bt_k: torch.Tensor,
                  info: LoRABatchInfo, blocks: torch.Tensor | None) -> torch.Tensor:
        """A bf16 prefill's deltas added into ``out`` in place, in bf16 on the kernel's bf16
        copies of the weights (``a_k [slots, R, in]``, ``bt_k [slots, R, out]``): the shrink's
        rank-sized product is rounded to bf16 (as peft's bf16 layers do), the expand is an
        ``addmm_`` that adds into ``out`` and rounds once. Where the float32 path
        (``_add_groups``) cast the activations to float32 per adapter and gathered and
        scattered each adapter's rows of the output (``index_add_`` on a 1,024 x 9,728 bf16
        output): on ``small``'s 1,024-row prefill that was most of LoRA's extra time."""
        wide = None
        if blocks is not None and blocks.shape[0] > 1:
            spans = blocks.tolist()
            if all(c1 - c0 >= WIDE_BLOCK_COLS for _, _, c0, c1 in spans):
                wide = spans

        def expand(o: torch.Tensor, xa: torch.Tensor, bt: torch.Tensor) -> None:
            if wide is None:
                o.addmm_(xa, bt)
                return
            for r0, r1, c0, c1 in wide:
                o[:, c0:c1].addmm_(xa[:, r0:r1], bt[r0:r1, c0:c1])

        adapter_rows = sum(length for _, length, _ in info.runs)
        if info.runs and len(info.runs) * RUN_ROWS <= adapter_rows:
            for start, length, slot in info.runs:
                rows = slice(start, start + length)
                expand(out[rows], x[rows] @ a_k[slot].T, bt_k[slot])
            return out
        for slot, rows in info.groups:
            if isinstance(rows, slice):
                expand(out[rows], x[rows] @ a_k[slot].T, bt_k[slot])
            else:
                xa = x.index_select(0, rows) @ a_k[slot].T
                for r0, r1, c0, c1 in wide or ((0, xa.shape[1], 0, out.shape[1]),):
                    out[:, c0:c1].index_add_(0, rows, xa[:, r0:r1] @ bt_k[slot, r0:r1, c0:c1])
        return out

    def _kernel_weights(
        self, a: torch.Tensor, b: torch.Tensor, version: int, dtype: torch.dtype,
        blocks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a layer's weights in ``dtype`` (bf16 for a bf16 model: half the bytes a
        decode step streams), made on first use and rewritten in place when the pool's
        ``version`` changes (a traced CPU graph holds them): ``a``, and B transposed: with
        ``blocks`` (the decode kernel's layout, ``csrc/lora.cpp``) each block's ranks x columns
        in chunks of ``LORA_CHUNK`` columns, ``[slots, P]``, so a chunk's weights are one
        contiguous stream and the zero blocks are left out; without, ``[slots, R, out]`` (a
        bf16 prefill's ``addmm_`` operand)."""
        if self._bt_version != version:
            for _, copy, make in self._bt.values():
                copy.copy_(make())
            self._bt_version = version

        def cached(kind: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
            entry = self._bt.get((id(a), kind))
            if entry is None or entry[0] is not a or entry[1].dtype != dtype:
                entry = (a, make().to(dtype).contiguous(), make)  # ``a`` held: its id is not
                self._bt[(id(a), kind)] = entry  # reused while the entry lives
            return entry[1]

        def chunks() -> torch.Tensor:
            assert blocks is not None
            parts = []
            for r0, r1, c0, c1 in blocks.tolist():
                count = -(-(c1 - c0) // LORA_CHUNK)
                part = torch.nn.functional.pad(b[:, c0:c1, r0:r1].transpose(1, 2),
                                               (0, count * LORA_CHUNK - (c1 - c0)))
                part = part.reshape(b.shape[0], r1 - r0, count, LORA_CHUNK).transpose(1, 2)
                parts.append(part.reshape(b.shape[0], -1))
            return torch.cat(parts, dim=1)

        a_k = a if a.dtype == dtype else cached("a", lambda: a)
        if blocks is not None:
            return a_k, cached("chunks", chunks)
        return a_k, cached("rows", lambda: b.transpose(1, 2))

    def forward_native(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo,
        reduce: Reduce | None = None,
    ) -> torch.Tensor:
        slots = info.token_slots
        has = slots >= 0
        safe = slots.clamp(min=0)
        xa = torch.einsum("ti,tri->tr", x.to(a.dtype), a[safe])
        if reduce is not None:
            xa = reduce(xa)
        delta = torch.einsum("tr,tor->to", xa, b[safe])
        return (delta * has.unsqueeze(1).to(delta.dtype)).to(x.dtype)

    def forward_cpu(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo,
        reduce: Reduce | None = None,
    ) -> torch.Tensor:
        if info.static:  # a graph's step replayed eagerly (tests on CPU): rows unknown here
            return self.forward_native(x, a, b, info, reduce)
        dtype, x = x.dtype, x.to(a.dtype)
        if info.present is not None and x.shape[0] <= SMALL_BATCH_ROWS:
            return self._several_adapters(x, a, b, info, reduce).to(dtype)
        if reduce is not None:  # shrink every group, sum over the group, then expand
            xa = x.new_zeros(x.shape[0], a.shape[1])
            for slot, rows in info.groups:
                xa[rows] = x[rows] @ a[slot].T
            xa = reduce(xa)
            out = x.new_zeros(x.shape[0], b.shape[1])
            for slot, rows in info.groups:
                out[rows] = xa[rows] @ b[slot].T
            return out.to(dtype)
        return self._add_groups(x.new_zeros(x.shape[0], b.shape[1], dtype=dtype), x, a, b, info)

    def forward_cuda(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo,
        reduce: Reduce | None = None,
    ) -> torch.Tensor:
        from radixserve.layers.lora import triton_lora

        assert info.seg_starts is not None and info.seg_lens is not None
        assert info.seg_slots is not None
        return triton_lora.lora_delta(
            x, a, b, info.seg_starts, info.seg_lens, info.seg_slots, info.max_seg_len, reduce
        )

    def _several_adapters(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo,
        reduce: Reduce | None,
    ) -> torch.Tensor:
        """Rows of several adapters in two matmuls: every row against the A of all adapters
        present, masked to its own adapter's block, then against their B side by side (fewer,
        larger ops than one pair per adapter: on CPU a step's cost is mostly per op)."""
        assert info.present is not None
        a_t, b_t = self._stacked_weights(a, b, info)
        xa = torch.mm(x, a_t).mul_(info.mask(a.shape[1], a.dtype))
        if reduce is not None:
            xa = reduce(xa)
        return torch.mm(xa, b_t)

    def _stacked_weights(
        self, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A_p^T [in, P*W], B_p^T [P*W, out])`` of the adapters present, both contiguous
        row-major for ``mm``; built once per layer for a set of adapters and pool version."""
        key = (info.present_slots, info.weights_version)
        if not info.present_slots or self._stacked_for != key:
            self._stacked.clear()
            self._stacked_for = key if info.present_slots else None
        entry = self._stacked.get(id(a))
        if entry is not None and entry[0] is a:
            return entry[1], entry[2]
        assert info.present is not None
        slots, width = len(info.present), a.shape[1]
        present = info.present.to(a.device)
        a_t = a.index_select(0, present).reshape(slots * width, a.shape[2]).T.contiguous()
        b_t = b.index_select(0, present).permute(0, 2, 1).reshape(slots * width, -1)
        b_t = b_t.contiguous()
        if info.present_slots:
            self._stacked[id(a)] = (a, a_t, b_t)  # ``a`` held: its id is not reused meanwhile
        return a_t, b_t
