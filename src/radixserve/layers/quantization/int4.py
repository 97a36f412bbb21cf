"""4-bit weights, ``--quantization int4``: each output channel's inputs in groups of 32, each group
with an fp16 scale ``d`` and offset ``m`` and a 4-bit code ``q`` in [0, 15] per weight, ``w ≈ d
* q + m`` — GGUF's Q4_1 block, the format llama.cpp and Ollama serve small CPU models in.

Why it exists: a batch-1 decode step reads every weight once, so on a CPU its time is the
weights' bytes over the memory bandwidth. 4.5 bits a weight plus the 1 bit of scale and offset
is 0.69 of int8's bytes and 0.34 of bf16's (``csrc/linear_int4.cpp``).

Quantisation is Q4_1's rule per group: ``m = min``, ``d = (max - min) / 15`` (both rounded to
fp16), ``q = round((w - m) / d)``. A GGUF file's Q4_1 tensors therefore come back as the codes,
scales and offsets they were stored with when the model is served in float32 (the dequantised
values' group minimum and maximum are the stored ``m`` and ``m + 15 d``); in bf16 the loaded
weights are rounded first, and the result is within that rounding. Other GGUF types (Q4_K, Q6_K,
Q8_0) and float checkpoints are quantised from their float values. The LM head is quantised to
int8 instead, symmetric with a scale per 32 inputs: Q8_0's block (a Q8_0 head comes back
exactly in float32), as GGUF files keep the head at 6 or 8 bits; its logits decide every token.

``Int4Weight`` is the ``PackedWeight``: natively it multiplies with the dequantised weight in
float32 (the reference, any device); on CPU, ``CpuInt4Weight`` adds radixserve's kernel and
oneDNN on the dequantised weight, ``kernel_dispatch`` choosing by batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_kernels, kernel_dispatch
from radixserve.layers.custom_op import OpImpl
from radixserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod, sharded_parameter
from radixserve.layers.packed_weight import MultiKernelWeight, PackedWeight, PackOptions
from radixserve.layers.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from radixserve.layers.linear_method import LinearLayer

GROUP = cpu_kernels.INT4_GROUP  # inputs per scale and offset
CODE_MAX = 15
FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` → (uint8 codes ``[N, K]`` in [0, 15], fp16 scales and offsets
    ``[N, ceil(K / 32)]``), ``weight ≈ code * scale + offset`` per group of 32 inputs (the last
    group may be shorter)."""
    n, k = weight.shape
    groups = -(-k // GROUP)
    w = weight.detach().float()
    if not torch.isfinite(w).all() or w.abs().max() > FP16_MAX:
        raise ValueError("int4 quantisation needs finite weights within fp16's range")
    # pad the last group with copies of its last value: they change neither its min nor max
    padded = torch.cat([w, w[:, -1:].expand(n, groups * GROUP - k)], dim=1)
    grouped = padded.view(n, groups, GROUP)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / CODE_MAX).to(torch.float16)
    offsets = low.to(torch.float16)
    d, m = scales.float()[..., None], offsets.float()[..., None]
    safe = torch.where(d > 0, d, torch.ones_like(d))  # a constant group: every code 0
    codes = torch.round((grouped - m) / safe).clamp_(0, CODE_MAX).to(torch.uint8)
    return codes.view(n, groups * GROUP)[:, :k].contiguous(), scales, offsets


def dequantize_int4(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """float32 ``code * scale + offset``, each scale and offset over its group of 32 inputs."""
    k = codes.shape[1]
    d = scales.float().repeat_interleave(GROUP, dim=1)[:, :k]
    m = offsets.float().repeat_interleave(GROUP, dim=1)[:, :k]
    return codes.float() * d + m


class Int4Weight(PackedWeight):
    """``weight``: uint8 codes ``[N, K]``; ``scales``, ``offsets``: fp16 ``[N, groups]``.
    Natively ``x @ dequantised.T`` in float32, rounded once to ``x``'s dtype (the reference)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> None:
        super().__init__(codes)
        self.scales, self.offsets = scales, offsets

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x.float(), dequantize_int4(self.weight, self.scales, self.offsets))
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


class CpuInt4Weight(MultiKernelWeight, Int4Weight):
    """The CPU kernel's copies (``cpu_kernels.pack_int4_weight``): activations quantised per row
    to int16 inside the kernel, as for int8 (``int4_vnni``); or oneDNN on the weight dequantised
    to the activations' dtype per call (``int4_dequant_onednn``: a prefill's GEMM outruns the
    kernel, and dequantising costs one pass over the weight)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> None:
        Int4Weight.__init__(self, codes, scales, offsets)
        self.activation_dtype = torch.bfloat16
        self.n = codes.shape[0]
        self.blocked, self.blocked_scales, self.blocked_offsets = cpu_kernels.pack_int4_weight(
            codes, scales, offsets
        )
        self.candidates = (kernel_dispatch.INT4_VNNI, kernel_dispatch.INT4_DEQUANT)
        self.restrict(batch_invariant=False)

    def kind(self) -> str:
        return f"int4-{str(self.activation_dtype).removeprefix('torch.')}"

    def kernels(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]:
        return {
            kernel_dispatch.INT4_VNNI: self.linear_vnni,
            kernel_dispatch.INT4_DEQUANT: self.linear_dequant,
        }

    def linear_vnni(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return cpu_kernels.linear_int4(
            x, self.blocked, self.blocked_scales, self.blocked_offsets, bias, self.n
        )

    def linear_dequant(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = dequantize_int4(self.weight, self.scales, self.offsets).to(x.dtype)
        return F.linear(x, weight, bias)

    def timing_proxy(self, max_out: int) -> CpuInt4Weight:
        if self.n <= max_out:
            return self
        proxy = CpuInt4Weight(
            self.weight[:max_out], self.scales[:max_out], self.offsets[:max_out]
        )
        proxy.activation_dtype, proxy.candidates = self.activation_dtype, self.candidates
        return proxy

    def extra_bytes(self) -> int:
        copies = (self.blocked, self.blocked_scales, self.blocked_offsets)
        return sum(t.numel() * t.element_size() for t in copies)


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, impl: OpImpl
) -> Int4Weight:
    """The ``PackedWeight`` of a 4-bit weight for a layer built with ``impl``."""
    if impl is OpImpl.CPU and cpu_kernels.has_ops("linear_int4"):  # not in an AVX2 build
        return CpuInt4Weight(codes, scales, offsets)
    return Int4Weight(codes, scales, offsets)


class Int4AtLoadMethod(LinearMethod):
    """Loads the float weight as an unquantised layer does, then, when packed, replaces it by its
    4-bit codes (``weight`` uint8) with ``weight_scale`` and ``weight_offset`` (fp16 ``[N,
    groups]``): the float copy is freed, and a second packing reuses the codes."""

    def create_weights(self, layer: LinearLayer, input_size: int, output_size: int) -> None:
        UnquantizedLinearMethod().create_weights(layer, input_size, output_size)

    def pack(self, layer: LinearLayer, options: PackOptions) -> PackedWeight:
        if layer.weight.dtype != torch.uint8:
            codes, scales, offsets = quantize_int4(layer.weight)
            loader = layer.weight_loader
            layer.weight = sharded_parameter(codes, loader, output_dim=0, input_dim=1)
            layer.weight_scale = sharded_parameter(scales, loader, output_dim=0, input_dim=None)
            layer.weight_offset = sharded_parameter(offsets, loader, output_dim=0, input_dim=None)
        return pack_int4(
            layer.weight.detach(), layer.weight_scale.detach(), layer.weight_offset.detach(),
            layer.impl,
        )


class Int4AtLoad(QuantizationConfig):
    """``--quantization int4``: linear layers at 4 bits, the LM head at int8."""

    name = "int4"

    def linear_method(self) -> LinearMethod:
        return Int4AtLoadMethod()

    def quantizes_lm_head(self) -> bool:
        return True

    def lm_head_group_size(self) -> int:
        """A scale per 32 inputs: Q8_0's block, so a GGUF file's Q8_0 head (SmolLM2's) comes
        back exactly, as its Q4_1 layers do (about 6% slower than one scale per row)."""
        return GROUP
