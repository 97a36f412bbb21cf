"""The one plug-in point for device fast paths: an op picks its implementation when it is built.

Models are built inside ``build_context(device, dtype)`` (``model_loader.load_model``): torch's
default device and dtype are the model's while its modules are constructed. Each ``CustomOp``
reads them once, in ``__init__``, and binds ``forward`` to one of its implementations:

    native  plain torch, any device and dtype: the reference every other implementation is
            tested against (``tests/layers/test_custom_ops.py``);
    cpu     radixserve's own kernels (``layers/cpu_kernels.py``), where they load on this CPU and
            take the model's dtype (``cpu_dtypes``);
    cuda    a CUDA kernel; ops without one use ``forward_native`` there.

After that nothing asks again: a call goes straight to the bound implementation. A new device
adds a ``forward_<device>`` to the ops that have kernels for it and one line to ``_select``; code
that calls the ops does not change. Weights follow the same rule through ``PackedWeight``
(``layers/packed_weight.py``): the layouts a device's kernels read are made once, after loading.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from radixserve.layers.cpu_kernels import has_ops


class OpImpl(enum.Enum):
    NATIVE = "native"
    CPU = "cpu"
    CUDA = "cuda"


@contextlib.contextmanager
def build_context(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Build modules on ``device`` with parameters created directly in ``dtype`` (no float32 copy
    first); the ``CustomOp``s built inside pick their implementation for this pair."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def select_impl(cpu_dtypes: tuple[torch.dtype, ...], cpu_ops: tuple[str, ...]) -> OpImpl:
    """The implementation an op whose CPU version calls the kernels ``cpu_ops``
    (``torch.ops.radixserve_cpu.<name>``) for ``cpu_dtypes`` takes in the current build context
    (torch's default device and dtype): CPU where this CPU's kernel build has them all."""
    device, dtype = torch.get_default_device(), torch.get_default_dtype()
    if device.type == "cpu" and dtype in cpu_dtypes and cpu_ops and has_ops(*cpu_ops):
        return OpImpl.CPU
    if device.type == "cuda":
        return OpImpl.CUDA
    return OpImpl.NATIVE


class CustomOp(nn.Module):
    """An op with a torch reference (``forward_native``) and faster per-device versions.

    Subclasses implement ``forward_native`` and override ``forward_cpu`` / ``forward_cuda``
    where they have kernels, and list in ``cpu_dtypes`` the model dtypes their CPU kernels take
    (a model in another dtype keeps the native path) and in ``cpu_ops`` the kernels
    ``forward_cpu`` calls (a CPU whose kernel build lacks one keeps the native path). The CPU
    and CUDA versions must return what ``forward_native`` returns, up to the rounding their
    docstrings state.
    """

    cpu_dtypes: tuple[torch.dtype, ...] = ()
    cpu_ops: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.impl = select_impl(self.cpu_dtypes, self.cpu_ops)
        self._forward: Callable[..., Any] = {
            OpImpl.NATIVE: self.forward_native,
            OpImpl.CPU: self.forward_cpu,
            OpImpl.CUDA: self.forward_cuda,
        }[self.impl]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"impl={self.impl.value}"
