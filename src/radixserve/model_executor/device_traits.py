"""How the model runner treats each kind of device, in one table: chosen once when a runner is
built (``device_traits(device)``), so that the runner has no branch per device, and a new
device adds an entry here, not ``if``s there."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import psutil
import torch


@dataclasses.dataclass(frozen=True)
class DeviceTraits:
    # The default --mem-fraction-static: the share of the free memory the weights' copies and
    # the KV pool may take (a CPU leaves room for the OS, the other processes and activations).
    mem_fraction_static: float
    # The KV pool lives in the machine's RAM: the allocator hands decoding requests runs of
    # slots (mem_cache/allocator.py, HOST_DECODE_RUN), and the ranks and replicas of the machine
    # share its memory when planning (--processes-per-node).
    host_memory: bool
    # Which decode graphs the runner records: "cuda" (cuda_graph_runner.py) or "cpu"
    # (cpu_graph_runner.py).
    decode_graphs: str
    # Whether --enable-deterministic-inference has batch-invariant kernels here.
    deterministic_kernels: bool
    # Free memory for the KV budget, and giving cached blocks back after a release.
    free_memory: Callable[[torch.device], int]
    empty_cache: Callable[[], None]


def _host_free(device: torch.device) -> int:
    return psutil.virtual_memory().available


def _cuda_free(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


TRAITS: dict[str, DeviceTraits] = {
    "cpu": DeviceTraits(mem_fraction_static=0.3, host_memory=True, decode_graphs="cpu",
                        deterministic_kernels=True, free_memory=_host_free,
                        empty_cache=lambda: None),
    "cuda": DeviceTraits(mem_fraction_static=0.85, host_memory=False, decode_graphs="cuda",
                         deterministic_kernels=False, free_memory=_cuda_free,
                         empty_cache=torch.cuda.empty_cache),
}


def device_traits(device: torch.device) -> DeviceTraits:
    traits = TRAITS.get(device.type)
    if traits is None:
        raise ValueError(f"no model runner for device {device.type!r}; known: {sorted(TRAITS)}")
    return traits
