"""The scheduler process's adapters: which are loaded, in which slot, and applying them.

``LoRAManager`` is built by the model runner after the model's weights are packed. It

- owns the ``LoRAMemoryPool`` (``--max-loras-per-batch`` slots at ``--max-lora-rank``) and the
  loaded adapters (up to ``--max-loaded-loras``, their weights kept in host memory): a batch's
  adapters hold slots (``ensure_slots``, called when the scheduler admits requests), taking
  free ones first, then those of adapters the batch does not use (``--lora-eviction-policy``);
- registers a forward hook on each adapted linear layer (``qkv_proj``, ``o_proj``,
  ``gate_up_proj``, ``down_proj`` of every decoder layer of this rank) that adds the
  ``LoRADelta`` of this step's batch. A hook, not a wrapper module, so parameter names stay the
  checkpoint's (weight updates by name and the loader keep working);
- turns a ``ForwardBatch``'s per-request slots into per-row slots once per step (``prepare``).

Each load gets a new ``namespace`` (a positive int, never reused): the prefix cache keys a
request's tokens by it, so KV computed under one adapter (or an earlier load of the same name)
is never served to another.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.custom_op import build_context
from radixserve.layers.lora import LoRABatchInfo, LoRADelta
from radixserve.lora.adapter import (
    LORA_TARGET_MODULES,
    LoRAAdapter,
    LoRAAdapterError,
    ModuleShapes,
    load_adapter,
    read_config,
)
from radixserve.lora.graph_inputs import LoRAGraphInputs
from radixserve.lora.memory_pool import LoRAMemoryPool
from radixserve.lora.tp_shards import ROW_PARALLEL, RankShards

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRASettings:
    """The server arguments LoRA reads (SGLang's names)."""

    max_loras_per_batch: int = 8
    max_lora_rank: int = 16
    lora_target_modules: tuple[str, ...] = tuple(LORA_TARGET_MODULES)
    max_loaded_loras: int = 8  # adapters held at once (>= max_loras_per_batch)
    lora_eviction_policy: str = "lru"


def resolve_settings(
    max_loras_per_batch: int,
    max_lora_rank: int | None,
    lora_target_modules: list[str] | None,
    initial: dict[str, str],
    max_loaded_loras: int | None = None,
    lora_eviction_policy: str = "lru",
) -> LoRASettings:
    """The pool's shape: ``--max-lora-rank`` (default: the largest rank of the start-up
    adapters, 16 without) and ``--lora-target-modules`` (default: those the start-up adapters
    target, all without; ``all``: all)."""
    configs = [read_config(path) for path in initial.values()]
    rank = max_lora_rank or max((int(c.get("r") or 0) for c in configs), default=0) or 16
    if lora_target_modules is None and configs:
        wanted = set()
        for config in configs:
            targets = config.get("target_modules")
            wanted |= set(LORA_TARGET_MODULES if targets == "all-linear" else targets or ())
        targets_out = tuple(m for m in LORA_TARGET_MODULES if m in wanted)
    elif lora_target_modules is None or "all" in lora_target_modules:
        targets_out = tuple(LORA_TARGET_MODULES)
    else:
        targets_out = tuple(m for m in LORA_TARGET_MODULES if m in lora_target_modules)
    return LoRASettings(max_loras_per_batch, rank, targets_out,
                        max(max_loaded_loras or max_loras_per_batch, max_loras_per_batch),
                        lora_eviction_policy)


@dataclass(frozen=True)
class LoadedAdapter:
    adapter: LoRAAdapter  # its weights, in host memory while it holds no slot
    namespace: int


class LoRAManager:
    def __init__(
        self,
        model_config: Any,
        layers: range,
        settings: LoRASettings,
        device: torch.device,
        dtype: torch.dtype,
        tp: Any = None,
    ) -> None:
        """``layers``: the decoder layers this rank holds; ``tp``: its tensor-parallel group
        (a ``RankGroup``; None on one rank). The pool is allocated here, before the model (the
        KV plan counts it); ``attach`` hooks it into a loaded model."""
        self.settings = settings
        self.shapes = ModuleShapes.from_config(model_config)
        self.tp = tp if tp is not None and tp.size > 1 else None
        shards = RankShards()
        if self.tp is not None:
            shards = RankShards(self.tp.rank_in_group, self.tp.size,
                                model_config.num_key_value_heads, model_config.head_dim)
        # float32 on CPU: torch's small half-precision matmuls are several times slower there
        pool_dtype = torch.float32 if device.type == "cpu" else dtype
        self.pool = LoRAMemoryPool(
            self.shapes, layers, settings.max_loras_per_batch, settings.max_lora_rank,
            settings.lora_target_modules, device, pool_dtype, shards,
        )
        self.loaded: dict[str, LoadedAdapter] = {}
        # Which loaded adapters hold a pool slot, in eviction order (first: the next to leave).
        self.slot_of: dict[str, int] = {}
        self._namespaces = itertools.count(1)
        self.info: LoRABatchInfo | None = None
        self.device = device
        self.dtype = dtype
        self._graph_version: int | None = None  # the pool version the graphs' copies hold
        with build_context(device, dtype):  # the op picks its implementation for this pair
            self.op = LoRADelta()
        logger.info(
            "LoRA pool: %d slots, rank %d, %s: %.4g MiB",
            settings.max_loras_per_batch, settings.max_lora_rank,
            ",".join(settings.lora_target_modules), self.pool.nbytes() / 2**20,
        )

    def attach(self, model: nn.Module) -> None:
        """Hook every adapted linear layer of ``model`` (at start, and again for the model that
        a weight update or a memory resume loads)."""
        for (layer, fused), buf in self.pool.buffers.items():
            prefix = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            name = f"model.layers.{layer}.{prefix}.{fused}"
            try:
                module = model.get_submodule(name)
            except AttributeError as e:
                raise ValueError(
                    f"{type(model).__name__} has no {name}: this model does not support LoRA"
                ) from e
            # A row-parallel layer's rank holds a slice of A: sum the intermediate over ranks.
            row_parallel = self.tp is not None and buf.shards[0] in ROW_PARALLEL
            reduce = self.tp.all_reduce if row_parallel else None
            module.register_forward_hook(self._hook(buf.a, buf.b, reduce, buf.blocks))

    def _hook(
        self, a: torch.Tensor, b: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
        | None, blocks: torch.Tensor | None = None,
    ) -> Callable[..., Any]:
        def add_delta(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
            info = self.info
            if info is None or not info.any_adapter:
                return None  # keep the base layer's output
            return self.op.add_to(out, args[0], a, b, info, reduce, blocks)

        return add_delta

    # ------------------------------------------------------------------ adapters
    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read, check and hold the adapter at ``path`` under ``name`` (in a free slot if there
        is one; else a batch that uses it gives it one); a refusal raises ``LoRAAdapterError``
        (``ValueError``) and changes nothing."""
        if name in self.loaded:
            raise LoRAAdapterError(f"a LoRA adapter named {name!r} is already loaded")
        if not name or ":" in name:
            raise LoRAAdapterError(f"LoRA adapter name {name!r} must be non-empty, without ':'")
        most = self.settings.max_loaded_loras
        if len(self.loaded) >= most:
            raise LoRAAdapterError(
                f"{most} LoRA adapters are loaded (--max-loaded-loras; default "
                f"--max-loras-per-batch): {', '.join(sorted(self.loaded))}; unload one first"
            )
        adapter = load_adapter(
            name, path, self.shapes, self.settings.max_lora_rank,
            self.settings.lora_target_modules,
        )
        entry = LoadedAdapter(adapter, next(self._namespaces))
        self.loaded[name] = entry
        free = self._free_slots()
        if free:
            self._place(name, free[0])
        return entry

    def unload(self, name: str) -> None:
        entry = self.loaded.pop(name, None)
        if entry is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.pool.clear(slot)

    def _free_slots(self) -> list[int]:
        used = set(self.slot_of.values())
        return [s for s in range(self.pool.slots) if s not in used]

    def _place(self, name: str, slot: int) -> None:
        self.pool.write(slot, self.loaded[name].adapter)
        self.slot_of[name] = slot

    def ensure_slots(self, names: set[str]) -> dict[str, int]:
        """Give every adapter in ``names`` (at most ``max_loras_per_batch``, the scheduler's
        admission keeps to it) a slot, taking free slots first, then those of adapters outside
        ``names`` in eviction order (``--lora-eviction-policy``: least recently used, or first
        placed); adapters in ``names`` keep the slots they hold. Returns ``{name: slot}``."""
        assert len(names) <= self.pool.slots, (names, self.pool.slots)
        if self.settings.lora_eviction_policy == "lru":
            for name in sorted(names & self.slot_of.keys()):  # used now: last to leave
                self.slot_of[name] = self.slot_of.pop(name)
        for name in sorted(names - self.slot_of.keys()):
            free = self._free_slots()
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.slot_of if n not in names)
                slot = self.slot_of.pop(victim)
                logger.info("LoRA adapter %s leaves slot %d for %s", victim, slot, name)
            self._place(name, slot)
        return {name: self.slot_of[name] for name in names}

    def nbytes(self) -> int:
        """Memory the adapters take, counted before the KV cache is planned: the pool, and on
        CPU the op's copies of it (the kernel's per-version copies and the stacked weights of
        the adapters present, each at most the pool's size)."""
        return self.pool.nbytes() * (3 if self.device.type == "cpu" else 1)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "path": e.adapter.path, "rank": e.adapter.rank,
             "slot": self.slot_of.get(name)}
            for name, e in sorted(self.loaded.items())
        ]

    # ------------------------------------------------------------------ per step
    def ready_for_graphs(self) -> None:
        """Before a decode graph is traced or replayed: the op's copies of every adapted
        layer's weights made, or rewritten in place if the pool changed since (a traced CPU
        graph reads the tensors it recorded; ``LoRADelta.kernel_copies``)."""
        version = self.pool.version
        if self._graph_version == version:
            return
        for buf in self.pool.buffers.values():
            self.op.kernel_copies(buf.a, buf.b, buf.blocks, version, self.dtype)
        self._graph_version = version

    def graph_info(self, inputs: LoRAGraphInputs, bs: int) -> None:
        """Set a graph's decode step's rows: the slots in ``inputs``' buffers."""
        self.info = inputs.info(bs, self.pool.version)

    def prepare(self, forward_batch: ForwardBatch) -> None:
        """Set the rows' adapter slots for the step about to run."""
        slots = forward_batch.lora_slots
        if slots is None or all(s < 0 for s in slots):
            self.info = None
            return
        per_req = torch.tensor(slots, dtype=torch.int64)
        if forward_batch.forward_mode.is_extend:
            assert forward_batch.extend_seq_lens_cpu is not None
            counts = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
            per_row = per_req.repeat_interleave(counts)
        else:
            per_row = per_req
        self.info = LoRABatchInfo.from_token_slots(per_row, self.device, self.pool.version)


def create_lora_manager(
    settings: Any, model_config: Any, device: torch.device, parallel: Any
) -> LoRAManager | None:
    """The runner's manager when ``settings.enable_lora`` (a ``RunnerSettings``), else None."""
    if not settings.enable_lora:
        return None
    initial = _path_map(settings.lora_paths)
    lora_settings = resolve_settings(
        settings.max_loras_per_batch, settings.max_lora_rank, settings.lora_target_modules,
        initial, settings.max_loaded_loras, settings.lora_eviction_policy,
    )
    layers = parallel.info.stage_layers(model_config.num_hidden_layers)
    return LoRAManager(model_config, layers, lora_settings, device, model_config.torch_dtype,
                       parallel.tp)


def load_initial_adapters(manager: LoRAManager, lora_paths: list[str] | None) -> None:
    """Load ``--lora-paths`` at start; a bad folder fails the start with its reason."""
    for name, path in _path_map(lora_paths).items():
        entry = manager.load(name, path)
        logger.info("LoRA adapter %s (rank %d) from %s, slot %s", name,
                    entry.adapter.rank, path, manager.slot_of.get(name))


def _path_map(lora_paths: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in lora_paths or ():
        name, sep, path = entry.partition("=")
        out[name if sep else entry] = path if sep else entry
    return out
