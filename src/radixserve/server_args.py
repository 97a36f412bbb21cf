"""Server configuration: one frozen dataclass built by the CLI or by ``Engine(**kwargs)``.

Each component reads only the fields it needs; derived values are properties. Validation happens
in ``__post_init__`` so that a bad flag fails before any process starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

SCHEDULE_POLICIES = ("fcfs", "lpm")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# on: time the CPU kernels per linear shape and batch bucket once per machine (cached);
# off: the static table (layers/kernel_dispatch.py)
CPU_KERNEL_AUTOTUNE_MODES = ("on", "off")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# --kv-cache-dtype: SGLang's names with vLLM's aliases (bfloat16, fp8 = fp8_e4m3); what each
# stores is mem_cache/kv_quant.py's KV_CACHE_DTYPES
KV_CACHE_DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_STORAGE_BACKENDS = ("file",)
LORA_EVICTION_POLICIES = ("lru", "fifo")  # SGLang's --lora-eviction-policy


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    # model execution
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    random_seed: int = 0
    # parallelism (see distributed/ and managers/data_parallel_controller.py)
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1  # expert parallelism of MoE layers: a divisor of tp_size (fused_moe.py)
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous; chosen when one node
    dist_timeout: float = 600.0
    is_embedding: bool = False
    attention_backend: str | None = None  # None: cpu on CPUs whose kernels take the model
    quantization: str | None = None  # "int8", "int4": quantise a float checkpoint's weights at load
    cpu_kernel_autotune: str = "on"  # CPU_KERNEL_AUTOTUNE_MODES
    # memory
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    page_size: int = 1
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPE_CHOICES; auto: the model's dtype
    quantization_param_path: str | None = None  # a JSON of fp8 KV scales (model_executor/kv_scales)
    disable_radix_cache: bool = False
    # hierarchical cache (docs/hierarchical-cache.md)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host tier size / device pool size
    hicache_size: float = 0.0  # host tier in GB; overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    # scheduling
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 4096
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    # priority scheduling (docs/priority.md)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    enable_streaming_session: bool = False
    session_store: str | None = None
    session_store_max_gb: float = 10.0
    session_offload_after: float | None = None
    enable_overlap_schedule: bool = False  # on CPU; on CUDA the overlap schedule is the default
    disable_overlap_schedule: bool = False  # SGLang's flag: keep CUDA on the plain schedule
    # decode-step graphs: CUDA graphs, or traced CPU graphs (model_executor/*_graph_runner.py)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # None: max_running_requests
    max_sessions: int = 1024
    session_idle_timeout: float = 3600.0  # seconds; 0: sessions opened without one never expire
    # constrained decoding (JSON schemas)
    constrained_json_disable_any_whitespace: bool = False
    constrained_json_max_whitespace_cnt: int | None = None
    enable_deterministic_inference: bool = False
    # speculative decoding (docs/speculative.md)
    speculative_algorithm: str | None = None
    # None: 8 for NGRAM (its drafts), num_steps + 1 for STANDALONE (SGLang's count, with the
    # token the drafts follow)
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_draft_model_path: str | None = None
    speculative_draft_model_quantization: str | None = None  # e.g. int8 (the target as draft)
    speculative_num_steps: int | None = None  # STANDALONE: draft forwards per step (default 4)
    speculative_eagle_topk: int | None = None  # STANDALONE: 1 (chain drafts; no trees)
    # measured crossover (benchmarks/RESULTS.md, "batch-size switch-off"): NGRAM on the edit
    # workload paid at batch 1-2 and lost at 4 and 8 on a loaded 2-core CPU
    speculative_max_batch_size: int = 2
    # LoRA adapters (lora/, docs/lora.md)
    enable_lora: bool = False
    lora_paths: list[str] | None = None  # "name=path" or "path" (named by its path)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None  # None: max_loras_per_batch (every adapter in a slot)
    lora_eviction_policy: str = "lru"  # which slot a batch takes when all hold adapters
    max_lora_rank: int | None = None  # None: the largest rank of --lora-paths (16 without)
    lora_target_modules: list[str] | None = None  # None: those of --lora-paths (all without)
    # serving
    stream_interval: int = 1
    enable_metrics: bool = False
    max_queued_requests: int | None = 4096  # generations (prompts x n); None: unbounded
    max_n: int = 64
    max_batch_size: int = 2048
    max_top_logprobs_num: int = 20
    max_completion_tokens: int = 16384
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    responses_store_size: int = 1000
    responses_store_ttl: float = 3600.0
    batch_dir: str | None = None  # the Batch API's files and batches (docs/batch.md)
    batch_max_concurrency: int = 8  # requests of all batches running at once (docs/batch.md)
    log_requests: bool = False
    log_level: str = "info"
    skip_warmup: bool = False
    watchdog_timeout: float = 300.0
    health_timeout: float = 20.0
    request_read_timeout: float = 60.0

    def _check_priority_scheduling(self) -> None:
        """The priority flags only mean something with ``enable_priority_scheduling``: set
        without it they are refused, not ignored."""
        if not self.enable_priority_scheduling:
            given = [name for name, unset in (
                ("schedule_low_priority_values_first", False),
                ("priority_scheduling_preemption_threshold", 10),
                ("disable_priority_preemption", False), ("default_priority_value", None),
            ) if getattr(self, name) != unset]
            if given:
                raise ValueError(f"{', '.join(given)} needs enable_priority_scheduling")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 0, got "
                             f"{self.priority_scheduling_preemption_threshold}")

    def overlap_schedule_on(self, device_type: str) -> bool:
        """Whether a scheduler on ``device_type`` runs the overlap schedule: SGLang's default on
        CUDA (the scheduler's CPU work hides behind the GPU's forward; not with pipeline stages),
        unless ``--disable-overlap-schedule``; on CPU (where the forward and the scheduler share
        the cores) only with ``--enable-overlap-schedule``."""
        if self.enable_overlap_schedule:
            return True
        return device_type == "cuda" and not self.disable_overlap_schedule and self.pp_size == 1

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.cpu_kernel_autotune not in CPU_KERNEL_AUTOTUNE_MODES:
            raise ValueError(
                f"cpu_kernel_autotune must be one of {CPU_KERNEL_AUTOTUNE_MODES}, "
                f"got {self.cpu_kernel_autotune!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        self._check_priority_scheduling()
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantization_param_path is not None:
            if not self.kv_cache_dtype.startswith("fp8"):
                raise ValueError(
                    "quantization_param_path holds scales for an fp8 KV cache: it needs "
                    f"--kv-cache-dtype fp8_e4m3 (or fp8_e5m2), got {self.kv_cache_dtype!r}"
                )
            if not os.path.isfile(self.quantization_param_path):
                raise ValueError(f"quantization_param_path {self.quantization_param_path!r} "
                                 "is not a file")
        self._check_parallelism()
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        for name in ("max_total_tokens", "max_running_requests", "context_length",
                     "max_queued_requests", "constrained_json_max_whitespace_cnt",
                     "responses_store_size", "responses_store_ttl", "batch_max_concurrency"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(
                f"cuda_graph_max_bs must be at least 1, got {self.cuda_graph_max_bs}"
            )
        if self.chunked_prefill_size <= 0:
            raise ValueError(
                f"chunked_prefill_size must be positive, got {self.chunked_prefill_size}"
            )
        for name in ("session_store", "session_offload_after"):
            if getattr(self, name) is None:
                continue
            if not self.enable_streaming_session:
                raise ValueError(f"{name} needs enable_streaming_session")
            if self.tp_size * self.pp_size > 1:
                # every rank holds part of a session's KV, and offloads by its own clock
                raise ValueError(f"{name} does not combine with tensor or pipeline parallelism")
        if self.session_store_max_gb <= 0:
            raise ValueError(
                f"session_store_max_gb must be positive, got {self.session_store_max_gb}"
            )
        if self.session_offload_after is not None and self.session_offload_after < 0:
            raise ValueError(
                f"session_offload_after must be >= 0 seconds, got {self.session_offload_after}"
            )
        for name in ("max_n", "max_batch_size", "max_completion_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_top_logprobs_num < 0:
            raise ValueError(
                f"max_top_logprobs_num must be >= 0, got {self.max_top_logprobs_num}"
            )
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not 0 <= self.session_idle_timeout < float("inf"):
            raise ValueError(
                f"session_idle_timeout must be >= 0 seconds (0: none), got "
                f"{self.session_idle_timeout}"
            )
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        for name in ("watchdog_timeout", "health_timeout", "request_read_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_speculative()
        self._check_lora()
        self._check_hicache()
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    def _check_hicache(self) -> None:
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                             f"got {self.hicache_write_policy!r}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("hicache_ratio must be positive and hicache_size >= 0")
        if (self.hicache_storage_backend is not None
                and self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS):
            raise ValueError(f"hicache_storage_backend must be one of "
                             f"{HICACHE_STORAGE_BACKENDS}, got {self.hicache_storage_backend!r}")
        if (self.hicache_storage_backend is None) != (self.hicache_storage_dir is None):
            raise ValueError("hicache_storage_backend 'file' and hicache_storage_dir go together")
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                raise ValueError("hicache_storage_backend needs enable_hierarchical_cache")
            return
        if self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache")
        if self.tp_size * self.pp_size * self.dp_size > 1:
            raise ValueError("enable_hierarchical_cache runs on a single rank for now")

    def _check_parallelism(self) -> None:
        for name in ("tp_size", "pp_size", "ep_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.ep_size:
            raise ValueError(
                f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size}): the experts are "
                "split over groups of the tensor-parallel ranks"
            )
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, "
                f"got {self.load_balance_method!r}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            if self.dp_size > 1:
                raise ValueError(
                    "dp_size > 1 runs replicas on one machine; across machines put "
                    "sglang-router in front of one server per machine"
                )
            if (self.tp_size * self.pp_size) % self.nnodes:
                raise ValueError(
                    f"tp_size * pp_size ({self.tp_size * self.pp_size}) must be divisible by "
                    f"nnodes ({self.nnodes})"
                )
            if self.dist_init_addr is None:
                raise ValueError("nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}"
                )
        if self.pp_size > 1 and self.enable_overlap_schedule:
            raise ValueError(
                "the overlap schedule does not combine with pipeline parallelism (pp_size > 1): "
                "the pipeline keeps its stages busy with micro-batches instead"
            )
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError(
                "give --enable-overlap-schedule or --disable-overlap-schedule, not both"
            )
        if self.is_embedding and self.pp_size > 1:
            raise ValueError("an embedding model (--is-embedding) runs without pipeline stages")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be positive, got {self.dist_timeout}")

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            for name in ("speculative_draft_model_path", "speculative_draft_model_quantization",
                         "speculative_num_steps", "speculative_eagle_topk"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs speculative_algorithm")
            return
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} in this build, "
                f"got {algo!r}"
            )
        if algo == "NGRAM":
            for name in ("speculative_draft_model_path", "speculative_draft_model_quantization",
                         "speculative_num_steps", "speculative_eagle_topk"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for STANDALONE, not NGRAM")
            if self.speculative_num_draft_tokens is None:
                object.__setattr__(self, "speculative_num_draft_tokens", 8)
        else:
            self._check_standalone()
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
                     "speculative_max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        low = self.speculative_ngram_min_match_window_size
        if self.speculative_ngram_max_match_window_size < low:
            raise ValueError(
                "speculative_ngram_max_match_window_size must be >= "
                "speculative_ngram_min_match_window_size"
            )
        # The verify step runs on the normal loop of a single rank (docs/speculative.md).
        for name, bad in (("enable_overlap_schedule", self.enable_overlap_schedule),
                          ("tp_size > 1", self.tp_size > 1), ("pp_size > 1", self.pp_size > 1),
                          ("is_embedding", self.is_embedding)):
            if bad:
                raise ValueError(f"speculative_algorithm does not combine with {name}")

    def _check_standalone(self) -> None:
        """STANDALONE: a draft model; SGLang's counts (``num_draft_tokens`` = ``num_steps`` + 1
        with top-k 1, the token the drafts follow included), filled in from each other."""
        if self.speculative_draft_model_path is None:
            raise ValueError("speculative_algorithm STANDALONE needs speculative_draft_model_path")
        quant = self.speculative_draft_model_quantization
        if quant is not None and quant not in ("int8",):
            raise ValueError(
                f"speculative_draft_model_quantization must be 'int8', got {quant!r}"
            )
        if self.speculative_eagle_topk not in (None, 1):
            raise ValueError(
                "speculative_eagle_topk must be 1 for STANDALONE (chain drafts; tree drafts "
                f"are not in this build), got {self.speculative_eagle_topk}"
            )
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is None:
            steps = 4 if tokens is None else tokens - 1
        if tokens is None:
            tokens = steps + 1
        if steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
        if tokens != steps + 1:
            raise ValueError(
                f"speculative_num_draft_tokens must be speculative_num_steps + 1 = {steps + 1} "
                f"with speculative_eagle_topk 1, got {tokens}"
            )
        object.__setattr__(self, "speculative_num_steps", steps)
        object.__setattr__(self, "speculative_num_draft_tokens", tokens)
        object.__setattr__(self, "speculative_eagle_topk", 1)

    def _check_lora(self) -> None:
        if self.lora_paths and not self.enable_lora:  # as SGLang: adapters imply the flag
            object.__setattr__(self, "enable_lora", True)
        lora_set = [name for name in ("lora_paths", "max_lora_rank", "lora_target_modules",
                                      "max_loaded_loras")
                    if getattr(self, name) is not None]
        if not self.enable_lora:
            if lora_set:
                raise ValueError(f"{', '.join(lora_set)} need --enable-lora")
            return
        if self.is_embedding:
            raise ValueError("--enable-lora serves generation models, not --is-embedding")
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        names = [entry.partition("=")[0] if "=" in entry else entry
                 for entry in self.lora_paths or ()]
        self.lora_path_map  # noqa: B018 - raises for a malformed entry
        if len(set(names)) != len(names):
            raise ValueError(f"lora_paths names an adapter twice: {names}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras_per_batch "
                f"({self.max_loras_per_batch})"
            )
        if self.lora_eviction_policy not in LORA_EVICTION_POLICIES:
            raise ValueError(
                f"lora_eviction_policy must be one of {', '.join(LORA_EVICTION_POLICIES)}, "
                f"got {self.lora_eviction_policy!r}"
            )
        most = self.max_loaded_loras or self.max_loras_per_batch
        if len(names) > most:
            raise ValueError(
                f"lora_paths has {len(names)} adapters; at most {most} are loaded at once "
                "(max_loaded_loras, default max_loras_per_batch)"
            )
        modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for module in self.lora_target_modules or ():
            if module not in (*modules, "all"):
                raise ValueError(
                    f"lora_target_modules: {module!r} is not one of {', '.join(modules)}, all"
                )

    @property
    def lora_path_map(self) -> dict[str, str]:
        """``--lora-paths`` as ``{name: path}`` (a bare path is named by itself, as SGLang
        does)."""
        out: dict[str, str] = {}
        for entry in self.lora_paths or ():
            name, sep, path = entry.partition("=")
            if not sep:
                name, path = entry, entry
            if not name or not path:
                raise ValueError(f"lora_paths entry {entry!r} is not NAME=PATH or PATH")
            out[name] = path
        return out

    @property
    def ranks_per_replica(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        """Scheduler ranks of one replica that run on each machine."""
        return self.ranks_per_replica // self.nnodes

    @property
    def processes_per_node(self) -> int:
        """Scheduler processes on one machine (all replicas): they share its memory on CPU."""
        return self.ranks_per_node * self.dp_size

    @property
    def model_name(self) -> str:
        """The name clients use in the OpenAI ``model`` field."""
        return self.served_model_name or self.model_path

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.model_path

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def replace(self, **changes: object) -> ServerArgs:
        return dataclasses.replace(self, **changes)
