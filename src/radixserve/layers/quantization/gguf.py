"""GGUF tensors: the quantisation types we dequantise, and a lazy view of one tensor.

A GGUF weight ``[rows, cols]`` is stored row by row; a quantised row is a run of blocks of
``block_size`` values (Q8_0 and the legacy Q4_0/Q4_1/Q5_0/Q5_1: 32 values with one or two fp16
scales; the K-quants Q2_K to Q6_K: super-blocks of 256 values with a scale per sub-block),
so rows are independent. ``GgufTensor`` is the ``LazyWeight`` the model loader hands to a
parameter's ``weight_loader``: narrowing along rows (what a tensor-parallel rank, or a fused
layer's shard, does) picks rows of the packed data before anything is dequantised, so a rank
dequantises only its rows. Dequantisation is the ``gguf`` package's own
(``gguf.quants.dequantize``, numpy, float32), which is exact: every value it gives is
representable in float32. The loader's parameters then take them in the serving dtype, and
``--quantization int8`` quantises the linear layers per output channel when the model is packed
(``int8.py``), as it does for a float checkpoint.

A row permutation rides along for Llama's query and key projections, which llama.cpp's
converter stores with each head's rotary halves interleaved (``model_loader_gguf``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.layers.linear_method import RangedLazyWeight

# Types the loader dequantises (names of ``gguf.GGMLQuantizationType``).
SUPPORTED_GGUF_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


def check_tensor_types(tensors: Iterable[Any], path: str | Path, big_endian: bool = False) -> None:
    """Raise ``ValueError`` naming the first tensor stored in a type we do not dequantise. In a
    big-endian file only F32 and F16 are read: ``gguf``'s dequantisation takes the scales inside
    quantised blocks (and BF16 values) as little-endian."""
    for tensor in tensors:
        name = tensor.tensor_type.name
        if big_endian and name not in ("F32", "F16"):
            raise ValueError(
                f"GGUF tensor {tensor.name} in {path} is stored as {name} in a big-endian file; "
                "only F32 and F16 tensors are supported in big-endian files"
            )
        if name not in SUPPORTED_GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name} in {path} is stored as {name}, which is not "
                f"supported; supported types: {', '.join(SUPPORTED_GGUF_TYPES)}"
            )


def dequantize_rows(data: np.ndarray, qtype: Any) -> np.ndarray:
    """Packed GGUF rows (as ``GGUFReader`` gives them) → float32 values, one row per row."""
    from gguf import quants

    if data.dtype.byteorder in "<>":  # the floats of a file of the other endianness
        data = data.astype(data.dtype.newbyteorder("="))
    return np.asarray(quants.dequantize(data, qtype), dtype=np.float32)


class GgufTensor(RangedLazyWeight):
    """A tensor of an open GGUF file in torch's order (``[rows, cols]``), read lazily.

    ``row_order[i]`` is the stored row that logical row ``i`` comes from (None: the identity).
    ``narrow`` along dimension 0 selects stored rows; along dimension 1 it is applied after
    dequantising, since a row's blocks are only decoded whole.
    """

    def __init__(self, reader_tensor: Any, row_order: np.ndarray | None = None,
                 expert: int | None = None) -> None:
        """``expert``: of a stacked MoE tensor ``[experts, rows, cols]`` (``ffn_up_exps``),
        the ``[rows, cols]`` matrix of that one expert."""
        self.name: str = reader_tensor.name
        self._data: np.ndarray = reader_tensor.data
        self._qtype = reader_tensor.tensor_type
        # ggml lists dimensions innermost first
        shape = tuple(int(n) for n in reversed(list(reader_tensor.shape)))
        if expert is not None:
            if len(shape) != 3 or not 0 <= expert < shape[0]:
                raise ValueError(f"GGUF tensor {self.name} {shape} has no expert {expert}")
            self.name = f"{self.name}[{expert}]"
            self._data, shape = self._data[expert], shape[1:]
        self._ranges = [(0, n) for n in shape]
        self._row_order = row_order

    def load(self) -> torch.Tensor:
        """float32 values of the narrowed tensor."""
        if len(self._ranges) == 1:
            lo, hi = self._ranges[0]
            values = dequantize_rows(self._data.reshape(1, -1), self._qtype).reshape(-1)
            return torch.from_numpy(values[lo:hi].copy())
        if len(self._ranges) != 2:
            raise ValueError(f"GGUF tensor {self.name} has {len(self._ranges)} dimensions")
        (r0, r1), (c0, c1) = self._ranges
        rows: Sequence[int] | slice = slice(r0, r1)
        if self._row_order is not None:
            rows = self._row_order[r0:r1]
        values = dequantize_rows(self._data[rows], self._qtype)[:, c0:c1]
        # F32 rows are a view of the read-only memory map: copy them out of it
        copy = None if values.flags.writeable else True
        return torch.from_numpy(np.array(values, order="C", copy=copy))

    def __repr__(self) -> str:
        return f"GgufTensor({self.name}, {self._qtype.name}, {self.shape})"
