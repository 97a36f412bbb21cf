"""Owns the model and its memory on one device: weights, request slots, KV pool, attention.

Construction order matters: the KV budget is planned first (from free memory minus the weights'
size read from the checkpoint headers), the pools and the attention backend are created, and the
model is built around that backend and loaded. ``forward`` then runs one ``ForwardBatch`` and
returns the logits (model dtype) of the last token of each request; ``sample`` turns them into
tokens.

With tensor or pipeline parallelism a runner holds one rank's part: its KV pool stores this
rank's KV heads of this stage's layers, and every rank of the replica agrees on the number of KV
slots (the smallest any rank can afford), because their schedulers take identical decisions.
A stage that is not the last returns its ``StageActivations`` from ``forward``.

On CUDA, once the pools and the model exist, decode steps are captured in CUDA graphs
(``cuda_graph_runner.py``) unless ``--disable-cuda-graph``: with the ``triton`` attention backend
(the only one whose decode reads no host value) on a single rank. The graphs record the weights'
and the KV pool's addresses, so releasing either drops them and bringing them back (or loading
new weights) captures them again. On CPU the same runner's buckets are traced instead
(``cpu_graph_runner.py``: TorchScript graphs that skip the Python between the kernels), where
the forward's Python decisions depend on the batch size alone.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from typing import TYPE_CHECKING, Any

import psutil
import torch

from radixserve.distributed import ParallelState
from radixserve.forward_batch import ForwardBatch, StageActivations
from radixserve.layers.attention import create_attention_backend, default_attention_backend
from radixserve.layers.custom_op import build_context
from radixserve.layers.fused_moe import FusedMoE
from radixserve.layers.linear import kv_heads_per_rank
from radixserve.layers.packed_weight import planned_copy_bytes
from radixserve.lora.graph_inputs import LoRAGraphInputs
from radixserve.lora.lora_manager import create_lora_manager, load_initial_adapters
from radixserve.mem_cache.allocator import HOST_DECODE_RUN, TokenToKVPoolAllocator
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.kv_quant import kv_dtype_name, kv_storage_dtype
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.model_config import ModelConfig, resolve_device
from radixserve.model_executor.cpu_graph_runner import CpuGraphRunner
from radixserve.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    capture_batch_sizes,
    graph_memory_bytes,
)
from radixserve.model_executor.device_traits import device_traits
from radixserve.model_executor.kv_scales import pool_layer_scales, read_kv_scales_file
from radixserve.model_executor.model_loader import (
    checkpoint_weight_bytes,
    load_model,
    route_checkpoint_name,
)
from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.layers.sampler import SampleOutput, Sampler

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# What a checkpoint must share with the served model to replace its weights in place.
_STRUCTURE = ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
MEMORY_TAGS = ("kv_cache", "weights")
_DEFAULT_MAX_RUNNING_REQUESTS = 256


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory on CUDA, available RAM on CPU (the device's traits)."""
    return device_traits(device).free_memory(device)


@dataclasses.dataclass(frozen=True)
class KVShare:
    """What a second runner on the same device (a speculative draft model,
    ``managers/scheduler/draft_proposer.py``) takes from the KV budget: its weights, and its KV
    bytes per token (it keeps as many token slots as this runner)."""

    weight_bytes: int
    kv_bytes_per_token: int


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """The server arguments the model runner reads (how much KV, which kernels), each field
    named as its server argument."""

    page_size: int = 1
    kv_cache_dtype: str = "auto"  # the KV pool's storage (mem_cache/kv_quant.py); auto: the model's
    quantization_param_path: str | None = None  # fp8 KV scales replacing the checkpoint's
    max_running_requests: int | None = None  # None: min(256, KV tokens)
    max_total_tokens: int | None = None  # None: planned from mem_fraction_static
    mem_fraction_static: float | None = None  # None: the device's default
    processes_per_node: int = 1  # processes sharing this machine's memory (CPU)
    attention_backend: str | None = None  # None: the device's default
    enable_deterministic_inference: bool = False  # only batch-invariant kernels
    disable_cuda_graph: bool = False  # decode eagerly (no CUDA graphs, no traced CPU graphs)
    cuda_graph_max_bs: int | None = None  # None: max_running_requests
    cpu_kernel_autotune: str = "off"  # "on": time the CPU linear kernels (the server's default)
    ep_size: int = 1  # MoE experts split over ep_size groups of the tensor-parallel ranks
    # LoRA (lora/lora_manager.py): adapters loaded at start and the pool's shape
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_eviction_policy: str = "lru"
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None

    @classmethod
    def from_args(cls, args: ServerArgs) -> RunnerSettings:
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        settings: RunnerSettings,
        device: torch.device | str,
        parallel: ParallelState | None = None,
        kv_share: KVShare | None = None,
    ) -> None:
        """``parallel``: this rank's place and groups (one process: ``ParallelState.single``);
        ``kv_share``: another model sharing this runner's memory budget (a speculative draft
        model), whose weights and per-token KV bytes the planned pool leaves room for."""
        self.kv_share = kv_share
        self.model_config = model_config
        self.device = resolve_device(device)
        self.traits = device_traits(self.device)  # every per-device choice below
        self.dtype = model_config.torch_dtype
        # --enable-deterministic-inference: only batch-invariant kernels (checked when packing)
        self.batch_invariant = settings.enable_deterministic_inference
        self.cpu_kernel_autotune = settings.cpu_kernel_autotune
        if self.batch_invariant and not self.traits.deterministic_kernels:
            raise ValueError("--enable-deterministic-inference runs on CPU only in this build")
        self.page_size = settings.page_size
        self.kv_cache_dtype = kv_storage_dtype(settings.kv_cache_dtype, self.dtype)
        self.vocab_size = model_config.vocab_size
        self.parallel = parallel or ParallelState.single()
        if settings.ep_size > 1 and self.parallel.distributed:  # not a draft model's runner
            self.parallel = dataclasses.replace(self.parallel, ep_size=settings.ep_size)
        info = self.parallel.info
        self.num_kv_heads = kv_heads_per_rank(model_config.num_key_value_heads, info.tp_size)
        self.num_layers = len(info.stage_layers(model_config.num_hidden_layers))
        self.kv_file_scales = None if settings.quantization_param_path is None else (
            read_kv_scales_file(settings.quantization_param_path, info.tp_rank, info.tp_size,
                                model_config.num_hidden_layers,
                                model_config.hf_config.get("model_type")))

        self.lora = create_lora_manager(settings, model_config, self.device, self.parallel)
        if not model_config.is_encoder:
            self.attention_backend = settings.attention_backend or default_attention_backend(
                self.device, self.kv_cache_dtype, model_config.head_dim
            )
        # The graphs are sized before the KV pool: their memory comes out of its budget.
        planned_graphs = self._cuda_graph_batch_sizes(
            settings, settings.max_running_requests or _DEFAULT_MAX_RUNNING_REQUESTS
        )
        self.graph_reserved_bytes = 0 if planned_graphs is None else graph_memory_bytes(
            planned_graphs, model_config.hidden_size, model_config.intermediate_size,
            model_config.vocab_size, model_config.num_attention_heads,
            self.num_kv_heads, model_config.head_dim, self.dtype,
        )
        self.max_total_num_tokens = self._plan_kv_tokens(settings)
        self.max_running_requests = settings.max_running_requests or min(
            _DEFAULT_MAX_RUNNING_REQUESTS, self.max_total_num_tokens
        )
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, model_config.context_len, self.device
        )
        # a pool in host memory: a request's generated tokens in runs (mem_cache/allocator.py)
        decode_run = HOST_DECODE_RUN if self.traits.host_memory and self.page_size == 1 else 1
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens, self.page_size, self.device, decode_run
        )
        # An encoder keeps no KV: its allocator only meters the tokens admitted per step.
        self.token_to_kv_pool: MHATokenToKVPool | None = None
        self.attn_backend = None
        if not model_config.is_encoder:
            self.token_to_kv_pool = self._create_kv_pool()
            self.attn_backend = create_attention_backend(
                self.attention_backend,
                self.req_to_token_pool,
                self.token_to_kv_pool,
                self.batch_invariant,
            )
            logger.info("attention backend: %s", self.attention_backend)
            choose = getattr(self.attn_backend, "choose_extend_kernels", None)
            if choose is not None:  # the cpu backend: its prefill kernel per extend length
                choose(model_config.num_attention_heads // info.tp_size, self.cpu_kernel_autotune)
        self.model: Any = self._load_model(model_config)
        self.released: set[str] = set()  # memory given back by release_memory (MEMORY_TAGS)
        # The served checkpoint's tensor shapes, read on the first weight sync.
        self._checkpoint_shapes: dict[str, list[int]] | None = None
        if self.lora is not None:
            load_initial_adapters(self.lora, settings.lora_paths)
        self.cuda_graph_batch_sizes = self._cuda_graph_batch_sizes(
            settings, self.max_running_requests
        )
        self.cpu_graph_batch_sizes = self._cpu_graph_batch_sizes(settings)
        self.graph_runner: CudaGraphRunner | None = None
        self._lora_graph_inputs: LoRAGraphInputs | None = None  # with LoRA, graphs' slots
        self._capture_graphs()

    def _cuda_graph_batch_sizes(
        self, settings: RunnerSettings, max_running_requests: int
    ) -> list[int] | None:
        """The decode batch sizes to capture, or None where this runner uses no CUDA graphs
        (chosen once, here: CUDA, not disabled, the triton backend, one rank, a decoder)."""
        if self.traits.decode_graphs != "cuda" or settings.disable_cuda_graph:
            return None
        reason = self._graph_off_reason(
            "triton", "reads host values in decode",
            "tensor and pipeline parallel ranks decode eagerly in this build",
        )
        return self._graph_sizes("CUDA", reason, settings, max_running_requests)

    def _cpu_graph_batch_sizes(self, settings: RunnerSettings) -> list[int] | None:
        """The decode batch sizes traced into CPU graphs (``cpu_graph_runner.py``) as they are
        first used, or None where this runner decodes eagerly on CPU: a trace freezes the
        Python decisions of its run, so only a forward whose decisions depend on the batch size
        alone is traced."""
        if self.traits.decode_graphs != "cpu" or settings.disable_cuda_graph:
            return None
        reason = self._graph_off_reason(
            "cpu", "decides per batch in Python",
            "tensor, pipeline and expert parallel ranks talk between the ops",
        )
        if reason is None and any(isinstance(m, FusedMoE) for m in self.model.modules()):
            reason = "MoE layers group the tokens by expert in Python"
        return self._graph_sizes("CPU", reason, settings, self.max_running_requests)

    def _graph_off_reason(self, backend: str, other_backend: str, ranks: str) -> str | None:
        """Why neither kind of decode graph runs here, for what both need: a decoder, the
        graphable attention ``backend`` (another one ``other_backend``), one rank (else
        ``ranks``)."""
        if self.model_config.is_encoder:
            return "an encoder has no decode steps"
        if self.attention_backend != backend:
            return f"the {self.attention_backend} attention backend {other_backend}"
        if self.parallel.distributed:
            return ranks
        return None

    @staticmethod
    def _graph_sizes(
        kind: str, reason: str | None, settings: RunnerSettings, max_running_requests: int
    ) -> list[int] | None:
        """SGLang's batch-size buckets up to ``--cuda-graph-max-bs`` (at most the running
        requests), or None with ``reason`` logged."""
        if reason is not None:
            logger.info("%s graphs off: %s", kind, reason)
            return None
        return capture_batch_sizes(
            min(settings.cuda_graph_max_bs or max_running_requests, max_running_requests)
        )

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """(Re)build the decode graphs: CUDA graphs where planned, else CPU graphs where
        allowed (traced lazily); after new weights or buffers, the old graphs hold stale ones."""
        sizes = self.cuda_graph_batch_sizes or self.cpu_graph_batch_sizes
        self._lora_graph_inputs = None if self.lora is None or not sizes else LoRAGraphInputs(
            max(sizes), self.device
        )
        if self.cuda_graph_batch_sizes is None:
            if self.cpu_graph_batch_sizes is not None:
                self.graph_runner = CpuGraphRunner(
                    self._decode_forward, self.device, self.cpu_graph_batch_sizes,
                    self._lora_graph_inputs,
                )
            return
        self.graph_runner = None
        on_cuda = self.traits.decode_graphs == "cuda"  # elsewhere only tests set the sizes
        before = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        runner = CudaGraphRunner(
            self._decode_forward, self.device, self.cuda_graph_batch_sizes,
            use_cuda_graph=on_cuda, lora_inputs=self._lora_graph_inputs,
        )
        runner.capture()
        self.graph_runner = runner
        if on_cuda:
            taken = torch.cuda.memory_reserved(self.device) - before
            logger.info(
                "CUDA graphs captured for decode batch sizes %s: %.3g GiB (%.3g GiB reserved "
                "for them in the KV budget)",
                self.cuda_graph_batch_sizes, taken / _GIB, self.graph_reserved_bytes / _GIB,
            )
            if taken > self.graph_reserved_bytes:
                logger.warning(
                    "the CUDA graphs took %.3g GiB more than the KV budget reserved for them; "
                    "lower --mem-fraction-static if later steps run out of memory",
                    (taken - self.graph_reserved_bytes) / _GIB,
                )

    def _decode_forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """One eager step: what a CUDA graph records (LoRA reads the graph's slot buffers)."""
        self.attn_backend.init_forward_metadata(forward_batch)
        if self.lora is not None:
            assert self._lora_graph_inputs is not None
            self.lora.graph_info(self._lora_graph_inputs, forward_batch.batch_size)
        return self.model(forward_batch, None)

    def _load_model(self, config: ModelConfig) -> Any:
        model = load_model(
            config, self.attn_backend, self.device, self.parallel, self.batch_invariant,
            self.cpu_kernel_autotune,
        )
        if self.parallel.ep_size > 1 and not any(isinstance(m, FusedMoE) for m in model.modules()):
            raise ValueError(f"--ep-size {self.parallel.ep_size} splits MoE experts, and "
                             f"{config.architecture} has none: leave it at 1")
        if self.lora is not None:
            self.lora.attach(model)
        return model

    def _create_kv_pool(self) -> MHATokenToKVPool:
        cfg = self.model_config
        pool = MHATokenToKVPool(
            self.max_total_num_tokens, self.page_size, self.kv_cache_dtype, self.num_kv_heads,
            cfg.head_dim, self.num_layers, self.device,
            layer_scales=self._kv_layer_scales(cfg.model_path),
        )
        logger.info(
            "KV cache: %d tokens, %.4g GiB (%s, page size %d); %d request slots",
            self.max_total_num_tokens,
            pool.size_bytes() / _GIB,
            kv_dtype_name(self.kv_cache_dtype) + (" with scales" if pool.quantized else ""),
            self.page_size,
            self.max_running_requests,
        )
        return pool

    def _kv_layer_scales(self, model_path: str,
                         quiet: bool = False) -> list[tuple[float, float]] | None:
        """This stage's layers' calibrated fp8 KV scales: --quantization-param-path's or the
        checkpoint's (``kv_scales.py``)."""
        layers = self.parallel.info.stage_layers(self.model_config.num_hidden_layers)
        return pool_layer_scales(model_path, self.kv_cache_dtype, layers, self.kv_file_scales,
                                 quiet)

    def _plan_kv_tokens(self, settings: RunnerSettings) -> int:
        """KV slots to allocate, rounded down to whole pages; the same on every rank.

        ``max_total_tokens`` wins when set; otherwise ``mem_fraction_static`` (default 0.3 on
        CPU, 0.85 on CUDA) of the memory left after the weights (and the kernels' packed copies
        of them), less what the CUDA graphs are expected to keep, divided by one token's KV
        bytes on this rank. On a CPU the ranks and replicas
        of a machine share its memory (``settings.processes_per_node``); each plans with its
        share.
        """
        cfg = self.model_config
        if settings.max_total_tokens is not None:
            tokens = settings.max_total_tokens
        else:
            fraction = settings.mem_fraction_static or self.traits.mem_fraction_static
            sharing = settings.processes_per_node if self.traits.host_memory else 1
            world = self.parallel.info.world_size
            weight_bytes = checkpoint_weight_bytes(cfg, self.dtype) * sharing // world
            weight_bytes += planned_copy_bytes(
                weight_bytes, self.device, self.dtype, psutil.virtual_memory().total
            )
            weight_bytes += self.lora.nbytes() if self.lora is not None else 0
            per_token = MHATokenToKVPool.bytes_per_token(
                self.num_kv_heads, cfg.head_dim, self.num_layers, self.kv_cache_dtype
            )
            if self.kv_share is not None:  # the draft model's weights and KV, token for token
                weight_bytes += self.kv_share.weight_bytes
                per_token += self.kv_share.kv_bytes_per_token
            budget = (available_memory_bytes(self.device) - weight_bytes) * fraction / sharing
            budget -= self.graph_reserved_bytes
            tokens = int(budget) // per_token
            agreed = torch.tensor([tokens], dtype=torch.int64)
            tokens = int(self.parallel.world.all_reduce(agreed, torch.distributed.ReduceOp.MIN))
        tokens = tokens // self.page_size * self.page_size
        if tokens <= 0:
            raise ValueError(
                f"not enough memory for a KV cache of one page ({self.page_size} tokens) on "
                f"{self.device}; lower the page size or raise max_total_tokens/mem_fraction_static"
            )
        return tokens

    @functools.cached_property
    def _sampler(self) -> Sampler:
        # Imported on first use: the runner's forward path does not depend on sampling code.
        from radixserve.layers.sampler import Sampler

        with build_context(self.device, self.dtype):  # its argmax op, for the model's logits
            return Sampler()

    @torch.inference_mode()
    def forward(
        self, forward_batch: ForwardBatch, previous_stage: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        """Next-token logits ``[batch_size, vocab_size]`` in the model's dtype (a pipeline stage
        other than the last: its activations, from the previous stage's ``previous_stage``); KV
        of the new tokens is stored at ``forward_batch.out_cache_loc``."""
        if forward_batch.batch_size == 0:
            return torch.empty((0, self.vocab_size), dtype=self.dtype, device=self.device)
        graphs = self.graph_runner
        if graphs is not None and previous_stage is None and graphs.can_run(forward_batch):
            if self.lora is not None:
                self.lora.ready_for_graphs()
            return graphs.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        if self.lora is not None:
            self.lora.prepare(forward_batch)
        return self.model(forward_batch, previous_stage)

    # ------------------------------------------------------------------ weights and memory
    def update_weights_from_disk(self, model_path: str, load_format: str | None) -> None:
        """Replace the weights with those of the checkpoint at ``model_path``.

        The new weights load into a second model first, so any problem (no checkpoint, another
        architecture or shape, a missing tensor, fp8 KV-cache scales other than those the pool
        stores its codes under) raises ``ValueError`` and the served weights stay as they were.
        The caller makes sure no batch runs meanwhile.
        """
        from radixserve.model_config import ModelConfig

        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r} is not supported (auto, safetensors)")
        new = ModelConfig.from_path(model_path, dtype="float32", device=self.device)
        for name in _STRUCTURE:
            if getattr(new, name) != getattr(self.model_config, name):
                raise ValueError(
                    f"the checkpoint at {model_path} does not match the served model: {name} "
                    f"is {getattr(new, name)!r}, the served model's is "
                    f"{getattr(self.model_config, name)!r}"
                )
        pool = self.token_to_kv_pool
        if pool is not None and pool.quantized and not pool.row_scaled:
            if self._kv_layer_scales(new.model_path, quiet=True) != pool.layer_scales:
                raise ValueError(
                    f"the checkpoint at {model_path} has other KV-cache scales (k_scale / "
                    f"v_scale) than the served model's, under which the fp8 KV cache is stored: "
                    f"restart the server to change them"
                )
        config = dataclasses.replace(self.model_config, model_path=new.model_path)
        model = self._load_model(config)
        self.model, self.model_config = model, config
        self._capture_graphs()  # the graphs read the old weights' addresses
        logger.info("weights updated from %s", model_path)

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write (checkpoint name, full tensor) pairs into the served weights (RL weight sync,
        ``weight_sync.py``): all are checked first, so a wrong name, shape or dtype raises
        ``ValueError`` with nothing changed; then the layers are packed again for their kernels.
        The caller makes sure no batch runs meanwhile and flushes the cache as asked."""
        from radixserve.layers.packed_weight import prepack_model
        from radixserve.model_executor import weight_sync

        if "weights" in self.released:
            raise ValueError("the weights are released (release_memory_occupation)")
        if self.model_config.quantization is not None:
            raise ValueError("weight sync of quantized (int8, int4) weights is not supported")
        if self._checkpoint_shapes is None:
            self._checkpoint_shapes = weight_sync.checkpoint_shapes(self.model_config.model_path)
        weight_sync.check_named_tensors(named_tensors, self._checkpoint_shapes)
        weight_sync.load_named_tensors(self.model, named_tensors)
        prepack_model(self.model, psutil.virtual_memory().total, self.batch_invariant,
                      self.cpu_kernel_autotune)
        self._capture_graphs()  # the graphs read the old packed layouts

    def get_weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        """The first ``truncate_size`` rows (or values) of checkpoint tensor ``name`` as the
        served model holds it; ``ValueError`` for an unknown or unreadable name."""
        if "weights" in self.released:
            raise ValueError("the weights are released (release_memory_occupation)")
        if self.parallel.distributed:
            raise ValueError(
                "get_weights_by_name reads whole tensors; with tensor or pipeline parallelism "
                "each rank holds only a part of them"
            )
        params = dict(self.model.named_parameters())
        target, shard_id = route_checkpoint_name(name, self.model.packed_modules_mapping)
        if target == "lm_head.weight" and target not in params:  # tied to the embedding
            target = "model.embed_tokens.weight"
        if target not in params:
            raise ValueError(f"the model has no parameter {name!r}")
        module = self.model.get_submodule(target.rsplit(".", 1)[0])
        tensor = params[target].detach()
        if shard_id is not None:
            offset, size = module.shard_range(shard_id)
            tensor = tensor.narrow(0, offset, size)
        return tensor[:truncate_size].float().cpu().tolist()

    def release_memory(self, tags: set[str]) -> None:
        """Free the KV pool (``kv_cache``) and/or the weights (``weights``) until ``resume``.
        The caller flushes the prefix cache: the KV contents are gone."""
        if "kv_cache" in tags and self.token_to_kv_pool is not None:
            self.token_to_kv_pool.release()
        if "weights" in tags:
            self.model = None
        self.graph_runner = None  # its graphs read the released buffers
        self.released |= tags
        gc.collect()
        self.traits.empty_cache()

    def resume_memory(self, tags: set[str]) -> None:
        """Reallocate the KV pool and/or reload the weights from the checkpoint they came from
        (``model_path``, or the last ``update_weights_from_disk``)."""
        tags = tags & self.released
        if "weights" in tags:
            self.model = self._load_model(self.model_config)
        if "kv_cache" in tags and self.token_to_kv_pool is not None:
            self.token_to_kv_pool.allocate()
        self.released -= tags
        if not self.released:
            self._capture_graphs()

    @torch.inference_mode()
    def embed(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """One float32 embedding per request ``[batch_size, hidden]`` of an EXTEND batch
        (embedding models: an encoder, or a decoder served with ``--is-embedding``)."""
        if self.attn_backend is not None:
            self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.embed(forward_batch)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, forward_batch: ForwardBatch) -> SampleOutput:
        """Next tokens (and logprobs when asked) for the logits ``forward`` returned; the rows
        after the first ``batch_size`` give the input logprobs (``ForwardBatch``)."""
        bs = forward_batch.batch_size
        out = self._sampler(
            logits[:bs],
            forward_batch.sampling_info,
            forward_batch.return_logprob,
            forward_batch.top_logprobs_nums,
            forward_batch.token_ids_logprobs,
        )
        counts = forward_batch.input_logprob_counts
        if counts is not None:
            from radixserve.layers.sampler import input_logprobs

            assert forward_batch.input_logprob_targets is not None
            out.input_logprobs = input_logprobs(
                logits[bs:],
                forward_batch.input_logprob_targets,
                counts,
                forward_batch.top_logprobs_nums,
                forward_batch.token_ids_logprobs,
            )
        return out
