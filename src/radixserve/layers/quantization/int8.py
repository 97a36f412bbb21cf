"""Int8 weights with a float32 scale per output channel (or per group of inputs), and
``--quantization int8``: quantising a float checkpoint's linear layers when the model is packed.

Quantisation is symmetric: ``scale = max |w| / 127`` over each output channel (or group), ``q =
round(w / scale)``, no zero point, so ``w ≈ q * scale`` and a product with ``x`` is the int8 sum
scaled once per group. ``Int8Weight`` is the ``PackedWeight`` of such a weight: natively it
multiplies with the dequantised weight in float32 (the reference); on CPU, radixserve's kernel
(``csrc/linear_int8.cpp``, ``csrc/avx2/linear_int8.cpp`` on CPUs with AVX2 but no AVX-512)
reads the int8 copy directly and streams half the bytes of bf16.
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

INT8_MAX = 127


def quantize_int8(
    weight: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` → (int8 ``[N, K]``, float32 scales ``[N, K / group_size]`` or
    ``[N, 1]`` per channel), symmetric: ``weight ≈ q * scale``."""
    n, k = weight.shape
    group = group_size or k
    w = weight.detach().float().reshape(n, k // group, group)
    scales = w.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays 0
    q = torch.round(w / safe[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale``, each scale over its group of ``K / groups`` inputs."""
    return q.float() * scales.repeat_interleave(q.shape[1] // scales.shape[1], dim=1)


class Int8Weight(PackedWeight):
    """``weight`` int8 ``[N, K]`` and ``scales`` float32 ``[N, groups]``. Natively: ``x @
    dequantised.T`` in float32, rounded once to ``x``'s dtype (the reference)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__(weight)
        self.scales = scales

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x.float(), dequantize_int8(self.weight, self.scales))
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


class CpuInt8Weight(MultiKernelWeight, Int8Weight):
    """The CPU kernel's copy: int8 ``[N/16][K/2][16][2]`` and scales ``[N/16][groups][16]``;
    activations are quantised per row to int16 inside the kernel (finer than bf16 for a row's
    large values), so results differ from the reference by about that rounding
    (``int8_vnni``). Or oneDNN on the weight converted to the activations' dtype
    (``int8_dequant_onednn``: exact for int8, the per-channel scale applied to the output),
    where its GEMM outruns the VNNI kernel at large batches; ``kernel_dispatch`` chooses."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        Int8Weight.__init__(self, weight, scales)
        self.activation_dtype = torch.bfloat16
        self.n = weight.shape[0]
        self.blocked, self.blocked_scales = cpu_kernels.pack_int8_weight(weight, scales)
        self.candidates = (kernel_dispatch.INT8_VNNI, kernel_dispatch.INT8_DEQUANT)
        self.restrict(batch_invariant=False)

    def kind(self) -> str:
        return f"int8-{str(self.activation_dtype).removeprefix('torch.')}"

    def kernels(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]:
        return {
            kernel_dispatch.INT8_VNNI: self.linear_vnni,
            kernel_dispatch.INT8_DEQUANT: self.linear_dequant,
        }

    def linear_vnni(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return cpu_kernels.linear_int8(x, self.blocked, self.blocked_scales, bias, self.n)

    def linear_dequant(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.scales.shape[1] == 1:  # per channel: x @ (q * s).T == (x @ q.T) * s
            out = F.linear(x, self.weight.to(x.dtype)) * self.scales[:, 0]
        else:
            out = F.linear(x, dequantize_int8(self.weight, self.scales).to(x.dtype))
        if bias is not None:
            out = out + bias
        return out.to(x.dtype)

    def timing_proxy(self, max_out: int) -> CpuInt8Weight:
        if self.n <= max_out:
            return self
        proxy = CpuInt8Weight(self.weight[:max_out], self.scales[:max_out])
        proxy.activation_dtype, proxy.candidates = self.activation_dtype, self.candidates
        return proxy

    def extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocked, self.blocked_scales))


def pack_int8(weight: torch.Tensor, scales: torch.Tensor, impl: OpImpl) -> Int8Weight:
    """The ``PackedWeight`` of an int8 weight for a layer built with ``impl``."""
    if impl is OpImpl.CPU and cpu_kernels.has_ops("linear_int8"):  # AVX-512 and AVX2 builds
        return CpuInt8Weight(weight, scales)
    return Int8Weight(weight, scales)


class Int8AtLoadMethod(LinearMethod):
    """Loads the float weight as an unquantised layer does, then, when packed, replaces it by its
    int8 quantisation (``weight`` int8, ``weight_scale`` float32 ``[N, 1]``): the float copy
    is freed, and a second packing reuses the int8 one."""

    def create_weights(self, layer: LinearLayer, input_size: int, output_size: int) -> None:
        UnquantizedLinearMethod().create_weights(layer, input_size, output_size)

    def pack(self, layer: LinearLayer, options: PackOptions) -> PackedWeight:
        if layer.weight.dtype != torch.int8:
            q, scales = quantize_int8(layer.weight)
            layer.weight = sharded_parameter(q, layer.weight_loader, output_dim=0, input_dim=1)
            layer.weight_scale = sharded_parameter(
                scales, layer.weight_loader, output_dim=0, input_dim=None
            )
        return pack_int8(layer.weight.detach(), layer.weight_scale.detach(), layer.impl)


class Int8AtLoad(QuantizationConfig):
    """``--quantization int8`` on a float checkpoint: linear layers and the LM head."""

    name = "int8"

    def linear_method(self) -> LinearMethod:
        return Int8AtLoadMethod()

    def quantizes_lm_head(self) -> bool:
        return True
