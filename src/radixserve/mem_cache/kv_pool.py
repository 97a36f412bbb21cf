"""The KV cache itself: per-layer K and V tensors indexed by KV slot.

Slots ``0..page_size-1`` form a reserved padding page that the allocator never hands out, so
usable slots are ``page_size..size+page_size-1``. Attention backends point the padding entries of
their slot tables at slot 0 and mask them, which keeps every gather in bounds.

Only the padding page is zeroed: every other slot is written before it is read, and leaving the
rest uninitialised keeps a large CPU pool from committing all of its RAM up front. Masked entries
still have to be finite (a NaN survives masking), which the zeroed padding page guarantees.

``dtype`` is the storage dtype (``--kv-cache-dtype``; the model's by default). A quantized one
(int8, fp8: ``mem_cache/kv_quant.py``) stores 8-bit codes in ``k_buffer``/``v_buffer`` and their
scales in ``k_scale_buffer``/``v_scale_buffer`` (``[size + page_size, head_num]`` float32 per
layer; empty lists otherwise): for int8 one scale per (slot, head), for fp8 the layer's one
scale (``layer_scales``: a calibrated checkpoint's, else 1.0) seen through a view with strides
(0, 0). ``slot_buffers(layer)`` lists every tensor of a layer that holds something per slot,
which is what a copy of slots (to another tier, to disk) must carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.mem_cache.kv_quant import (
    SCALE_DTYPE,
    TENSOR_SCALE,
    dequantize,
    has_row_scales,
    is_quantized,
    quantize,
    quantize_to_scale,
)


@dataclass(eq=False)
class MHATokenToKVPool:
    """K and V buffers of shape ``[size + page_size, head_num, head_dim]`` for each layer,
    allocated when the pool is made. A dataclass for its constructor; pools compare by identity."""

    size: int
    page_size: int
    dtype: torch.dtype
    head_num: int
    head_dim: int
    layer_num: int
    device: torch.device  # a str is accepted and converted
    # fp8's (K scale, V scale) of each layer: a calibrated checkpoint's (kv_scales.py), or None
    # for TENSOR_SCALE everywhere; unused by other dtypes
    layer_scales: list[tuple[float, float]] | None = None
    k_buffer: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)
    v_buffer: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)
    # a quantized pool's float32 scales, [slots, head_num] per layer; empty lists otherwise
    k_scale_buffer: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)
    v_scale_buffer: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        assert self.size % self.page_size == 0, (
            f"KV pool size {self.size} is not a multiple of {self.page_size}"
        )
        self.device = torch.device(self.device)
        if self.layer_scales is None:
            self.layer_scales = [(TENSOR_SCALE, TENSOR_SCALE)] * self.layer_num
        assert len(self.layer_scales) == self.layer_num, (
            f"{len(self.layer_scales)} layers' KV scales for {self.layer_num} layers"
        )
        self.allocate()

    def allocate(self) -> None:
        """(Re)create the buffers; only the padding page is zeroed (see the module docstring)."""
        shape = (self.size + self.page_size, self.head_num, self.head_dim)
        kwargs = {"dtype": self.dtype, "device": self.device}
        self.k_buffer = [torch.empty(shape, **kwargs) for _ in range(self.layer_num)]
        self.v_buffer = [torch.empty(shape, **kwargs) for _ in range(self.layer_num)]
        self.k_scale_buffer, self.v_scale_buffer = [], []
        if self.quantized:
            scale_shape = (self.size + self.page_size, self.head_num)
            kwargs = {"dtype": SCALE_DTYPE, "device": self.device}
            for part, scales in enumerate((self.k_scale_buffer, self.v_scale_buffer)):
                for layer in range(self.layer_num):
                    if self.row_scaled:
                        scales.append(torch.empty(scale_shape, **kwargs))
                    else:  # a 0-dim tensor expanded: strides 0, 0
                        one = torch.tensor(self.tensor_scale(layer)[part], **kwargs)
                        scales.append(one.expand(scale_shape))
        for layer in range(self.layer_num):
            for buffer in self.slot_buffers(layer):
                buffer[: self.page_size].zero_()

    @property
    def quantized(self) -> bool:
        """Whether the pool stores 8-bit codes (with their scales)."""
        return is_quantized(self.dtype)

    def tensor_scale(self, layer_id: int) -> tuple[float, float]:
        """The (K, V) scale of layer ``layer_id`` in a pool of one scale per layer (fp8)."""
        assert self.layer_scales is not None  # __post_init__ fills it
        return self.layer_scales[layer_id]

    @property
    def row_scaled(self) -> bool:
        """Whether the pool stores a scale per (slot, head) beside the codes (int8)."""
        return has_row_scales(self.dtype)

    def release(self) -> None:
        """Free the buffers (``release_memory_occupation``); ``allocate`` brings them back.
        Every slot's content is lost: the caller flushes whatever referred to it."""
        self.k_buffer, self.v_buffer = [], []
        self.k_scale_buffer, self.v_scale_buffer = [], []

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes across all layers (K and V, with their scales when ``dtype``
        has a scale per row): what the memory budget is divided by."""
        per_head = head_dim * dtype.itemsize
        if has_row_scales(dtype):
            per_head += SCALE_DTYPE.itemsize
        return 2 * layer_num * head_num * per_head

    def size_bytes(self) -> int:
        """Bytes held by all K and V buffers (and scales), padding page included."""
        return sum(
            b.numel() * b.element_size()
            for layer in range(len(self.k_buffer))
            for b in self.slot_buffers(layer)
        )

    def slot_buffers(self, layer_id: int) -> list[torch.Tensor]:
        """Every tensor of layer ``layer_id`` that holds a row per KV slot: K and V (or their
        codes), then per-row scales. Copying a slot means copying its row of each."""
        buffers = [self.k_buffer[layer_id], self.v_buffer[layer_id]]
        if self.row_scaled:
            buffers += [self.k_scale_buffer[layer_id], self.v_scale_buffer[layer_id]]
        return buffers

    def get_kv_scale_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V scales (``[slots, head_num]`` float32; fp8: one value, strides 0) of a
        quantized pool, else None."""
        if not self.quantized:
            return None
        return self.k_scale_buffer[layer_id], self.v_scale_buffer[layer_id]

    # ---- page copies between tiers (mem_cache/hiradix_cache.py, hicache_storage.py) -------------
    # The hierarchical cache moves KV between this pool, host memory and files only through the
    # three methods below, as opaque bytes per token: a pool that stores more per token (a
    # quantized pool's scales) extends them, and every tier carries what it returns unchanged.

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV takes in ``read_kv_pages``'s format (all layers, K and V)."""
        return self.bytes_per_token(self.head_num, self.head_dim, self.layer_num, self.dtype)

    def kv_layout(self) -> dict[str, object]:
        """What KV bytes of this pool mean: stored KV whose layout differs is never loaded."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_num": self.layer_num,
            "head_num": self.head_num,
            "head_dim": self.head_dim,
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "token_layout": "k_layers,v_layers" + (",k_scales,v_scales" if self.row_scaled else ""),
            # codes under a per-layer scale mean nothing under another
            "layer_scales": (
                [list(pair) for pair in self.layer_scales or ()]
                if self.quantized and not self.row_scaled else None
            ),
        }

    def _tier_buffers(self) -> list[torch.Tensor]:
        """The buffers a token's KV bytes come from, in ``read_kv_pages``'s order: K of every
        layer, V of every layer, then (per-row scales) the K scales and the V scales."""
        scales = self.k_scale_buffer + self.v_scale_buffer if self.row_scaled else []
        return self.k_buffer + self.v_buffer + scales

    def read_kv_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of ``slots`` (whole pages, in practice) as a CPU ``uint8`` tensor of shape
        ``[len(slots), kv_bytes_per_token()]``: per token, K of every layer then V of every
        layer, each ``[head_num, head_dim]``, then an int8 pool's scales (``[head_num]`` per
        layer, K then V)."""
        n = len(slots)
        if n == 0:
            return torch.empty((0, self.kv_bytes_per_token()), dtype=torch.uint8)
        index = slots.to(self.device)
        rows = [b[index].reshape(n, -1).view(torch.uint8) for b in self._tier_buffers()]
        data = torch.cat(rows, dim=1).cpu()
        assert data.shape == (n, self.kv_bytes_per_token()), data.shape
        return data

    def write_kv_pages(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (``read_kv_pages``'s format, on any device) into ``slots``."""
        n = len(slots)
        assert data.shape == (n, self.kv_bytes_per_token()), (
            f"KV bytes of shape {tuple(data.shape)} for {n} slots"
        )
        if n == 0:
            return
        data = data.to(self.device, non_blocking=True).contiguous()
        index = slots.to(self.device)
        start = 0
        for buffer in self._tier_buffers():
            width = buffer[0].numel() * buffer.element_size()
            part = data[:, start : start + width].contiguous().view(buffer.dtype)
            buffer[index] = part.view(n, *buffer.shape[1:])
            start += width

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` (``[n, head_num, head_dim]``) into slots ``loc`` (``[n]``),
        quantized with their scales when the pool is."""
        if not self.quantized:
            self.k_buffer[layer_id][loc] = k.to(self.dtype)
            self.v_buffer[layer_id][loc] = v.to(self.dtype)
            return
        if not self.row_scaled:
            k_scale, v_scale = self.tensor_scale(layer_id)
            self.k_buffer[layer_id][loc] = quantize_to_scale(k, self.dtype, k_scale)
            self.v_buffer[layer_id][loc] = quantize_to_scale(v, self.dtype, v_scale)
            return
        for codes, scales, x in (
            (self.k_buffer[layer_id], self.k_scale_buffer[layer_id], k),
            (self.v_buffer[layer_id], self.v_scale_buffer[layer_id], v),
        ):
            q, scale = quantize(x, self.dtype)
            codes[loc] = q
            scales[loc] = scale

    def get_dequantized(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` in ``dtype`` (``[n, head_num, head_dim]``), dequantized when the
        pool is quantized: the reference the backends' fused reads are tested against."""
        k = self.k_buffer[layer_id].index_select(0, slots)
        v = self.v_buffer[layer_id].index_select(0, slots)
        if not self.quantized:
            return k.to(dtype), v.to(dtype)
        ks = self.k_scale_buffer[layer_id].index_select(0, slots)
        vs = self.v_scale_buffer[layer_id].index_select(0, slots)
        return dequantize(k, ks, dtype), dequantize(v, vs, dtype)
