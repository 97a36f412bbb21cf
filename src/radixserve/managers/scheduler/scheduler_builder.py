"""Building a ``Scheduler`` for one rank: the model, the prefix cache, grammars, sessions and
the output path, each from the settings it reads (docs/architecture.md §4).

``build_scheduler`` is the one place where the scheduler's side reads ``ServerArgs``. The
``Scheduler`` receives what it composes (``SchedulerParts``), the few settings its own code reads
(``SchedulerSettings``, both in ``scheduler_parts.py``) and the loop that drives it (normal,
overlap or pipeline: ``choose_loop``): a new setting is wired here, to the component that uses
it, and a test can hand the scheduler parts built another way.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from radixserve import envs
from radixserve.constrained import GrammarCache, create_grammar_backend
from radixserve.constrained.limits import compile_timeout_s, step_budget_s
from radixserve.distributed import ParallelState
from radixserve.managers.scheduler.draft_proposer import (
    DraftModelProposer,
    build_draft_runner,
    load_draft_config,
)
from radixserve.managers.scheduler.output_processor import OutputProcessor
from radixserve.managers.scheduler.overlap_schedule import OverlapLoop
from radixserve.managers.scheduler.overlap_worker import OverlapWorker
from radixserve.managers.scheduler.pipeline_loop import PipelineLoop
from radixserve.managers.scheduler.prefill_planner import PrefillPlanner
from radixserve.managers.scheduler.priority_scheduling import PriorityScheduling
from radixserve.managers.scheduler.request_validation import RequestLimits
from radixserve.managers.scheduler.retraction import NewTokenRatio
from radixserve.managers.scheduler.schedule_batch import BatchResources
from radixserve.managers.scheduler.schedule_policy import SchedulePolicy
from radixserve.managers.scheduler.scheduler import Scheduler
from radixserve.managers.scheduler.scheduler_loop import LoopScheduler, NormalLoop, SchedulerLoop
from radixserve.managers.scheduler.scheduler_parts import SchedulerParts, SchedulerSettings
from radixserve.managers.scheduler.session_controller import SessionController
from radixserve.managers.scheduler.speculative_decoder import (
    SpeculativeDecoder,
    SpeculativeLoop,
    SpeculativeOutputProcessor,
)
from radixserve.managers.scheduler.tp_worker import TpModelWorker
from radixserve.mem_cache import (
    HiRadixCache,
    HostKVPool,
    create_hierarchical_cache,
    create_prefix_cache,
    create_session_store,
)
from radixserve.model_config import ModelConfig, resolve_device
from radixserve.model_executor.model_runner import RunnerSettings
from radixserve.server_args import ServerArgs
from radixserve.speculative import NgramProposer


def build_scheduler(
    server_args: ServerArgs,
    send_to_detokenizer: Callable[[Any], None],
    send_to_tokenizer: Callable[[Any], None],
    parallel: ParallelState | None = None,
    device: torch.device | None = None,
    dp_rank: int = 0,
    send_load: Callable[[Any], None] | None = None,
) -> Scheduler:
    """The scheduler of one rank. ``parallel``: its place (default: the only rank); ``device``:
    default ``server_args.device``; ``dp_rank``: its data-parallel replica; ``send_load``: where
    changes of its load go (the data-parallel controller)."""
    from radixserve.tokenizer_loader import load_tokenizer

    parallel = parallel or ParallelState.single()
    device = device or resolve_device(server_args.device)
    model_config = ModelConfig.from_path(
        server_args.model_path, server_args.dtype, device, server_args.context_length,
        server_args.quantization,
    )
    is_generation = not (server_args.is_embedding or model_config.is_encoder)
    runner_settings = RunnerSettings.from_args(server_args)
    draft_config = kv_share = None
    if server_args.speculative_algorithm == "STANDALONE" and is_generation:
        draft_config, kv_share = load_draft_config(server_args, model_config, device)
    tp_worker = TpModelWorker(model_config, runner_settings, device, parallel, kv_share)
    runner = tp_worker.model_runner
    draft_model = None
    if draft_config is not None:
        draft_model = DraftModelProposer(
            build_draft_runner(draft_config, runner_settings, runner)
        )
    if server_args.chunked_prefill_size < runner.page_size:
        raise ValueError(
            f"chunked_prefill_size ({server_args.chunked_prefill_size}) must be at least "
            f"page_size ({runner.page_size})"
        )
    # An encoder's tokens attend to what follows them: no prefix can be reused.
    radix_enabled = not (server_args.disable_radix_cache or model_config.is_encoder)
    store = None
    if server_args.enable_streaming_session:
        store = create_session_store(
            server_args.session_store, runner.token_to_kv_pool, server_args.model_path,
            server_args.session_store_max_gb,
        )
        if server_args.session_offload_after is not None and store is None:
            raise ValueError("--session-offload-after needs a session store: give "
                             "--session-store DIR (on a GPU, host memory is the default)")
    # With streaming sessions, the cache keeps each session's KV in a slot of its own.
    # With --enable-hierarchical-cache, the tree is a HiRadixCache over host and storage tiers.
    hierarchical = server_args.enable_hierarchical_cache and radix_enabled
    tree_cache = create_prefix_cache(
        not radix_enabled, runner.req_to_token_pool, runner.token_to_kv_pool_allocator,
        runner.page_size, streaming_sessions=server_args.enable_streaming_session,
        session_store=store, session_offload_after=server_args.session_offload_after,
        tree=_hierarchical_cache(server_args, runner) if hierarchical else None,
    )
    # For stop strings and grammars; the detokenizer makes the text.
    tokenizer = load_tokenizer(server_args.tokenizer)
    grammars = GrammarCache(
        partial(
            create_grammar_backend,
            tokenizer,
            model_config.vocab_size,
            model_config.eos_token_ids,
            any_whitespace=not server_args.constrained_json_disable_any_whitespace,
            max_whitespace_cnt=server_args.constrained_json_max_whitespace_cnt,
        )
    )
    sessions = SessionController(
        tree_cache, model_config.bos_token_id,
        max_sessions=server_args.max_sessions,
        default_timeout=server_args.session_idle_timeout or None,
    )
    speculative = server_args.speculative_algorithm is not None and is_generation
    output_processor = (SpeculativeOutputProcessor if speculative else OutputProcessor)(
        tree_cache,
        model_config.eos_token_ids,
        tokenizer,
        send_to_detokenizer,
        on_finish=sessions.on_req_finished,
        stream_interval=server_args.stream_interval,
        send_to_tokenizer=send_to_tokenizer,
        grammar_step_budget_s=step_budget_s(parallel.distributed),
    )
    new_token_ratio = NewTokenRatio.from_conservativeness(server_args.schedule_conservativeness)
    batch_resources = BatchResources(
        req_to_token_pool=runner.req_to_token_pool,
        allocator=runner.token_to_kv_pool_allocator,
        tree_cache=tree_cache,
        device=device,
        vocab_size=model_config.vocab_size,
        eos_token_ids=model_config.eos_token_ids,
        grammars=grammars,
    )
    priority = priority_scheduling(server_args)
    prefill_planner = PrefillPlanner(
        batch_resources,
        SchedulePolicy(server_args.schedule_policy, tree_cache, radix_enabled, priority),
        new_token_ratio,
        allow_chunking=not model_config.is_encoder,
        lora=runner.lora,
    )
    limits = RequestLimits(  # vocabulary, context, page, KV pool
        model_config.vocab_size, model_config.context_len, runner.page_size,
        runner.max_total_num_tokens, is_encoder=model_config.is_encoder,
    )
    parts = SchedulerParts(
        model_config=model_config,
        is_generation=is_generation,
        tp_worker=tp_worker,
        tree_cache=tree_cache,
        grammars=grammars,
        sessions=sessions,
        batch_resources=batch_resources,
        new_token_ratio=new_token_ratio,
        prefill_planner=prefill_planner,
        limits=limits,
        output_processor=output_processor,
        priority=priority,
    )
    settings = SchedulerSettings(
        max_prefill_tokens=server_args.max_prefill_tokens,
        chunked_prefill_size=server_args.chunked_prefill_size,
        watchdog_timeout=server_args.watchdog_timeout,
        waiting_timeout=waiting_timeout(parallel),
        grammar_timeout=compile_timeout_s(parallel.distributed),
    )
    make_loop = choose_loop(server_args, parallel, tp_worker, is_generation, draft_model)
    return Scheduler(
        parts, settings, send_to_tokenizer, parallel, make_loop, dp_rank, send_load
    )


def waiting_timeout(parallel: ParallelState) -> float:
    """RADIXSERVE_REQ_WAITING_TIMEOUT in seconds (<= 0: none). Each rank reads its own clock,
    and ranks that timed out different requests would run different batches: refused (the
    server does not start) with tensor, pipeline or data parallelism across ranks."""
    value = envs.RADIXSERVE_REQ_WAITING_TIMEOUT.get("0")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"RADIXSERVE_REQ_WAITING_TIMEOUT must be seconds, got {value!r}") from None
    if seconds > 0 and parallel.distributed:
        raise ValueError("RADIXSERVE_REQ_WAITING_TIMEOUT does not combine with tensor or "
                         "pipeline parallelism")
    return seconds


def priority_scheduling(server_args: ServerArgs) -> PriorityScheduling | None:
    """The priority settings with --enable-priority-scheduling (docs/priority.md), else None."""
    if not server_args.enable_priority_scheduling:
        return None
    return PriorityScheduling(
        low_values_first=server_args.schedule_low_priority_values_first,
        preemption=not server_args.disable_priority_preemption,
        threshold=server_args.priority_scheduling_preemption_threshold,
        default=server_args.default_priority_value,
    )


def _hierarchical_cache(server_args: ServerArgs, runner: Any) -> HiRadixCache:
    """``--enable-hierarchical-cache``: the host tier is ``--hicache-size`` GB, else
    ``--hicache-ratio`` times the device pool."""
    pool = runner.token_to_kv_pool
    if server_args.hicache_size > 0:
        host_tokens = HostKVPool.tokens_for_bytes(pool, int(server_args.hicache_size * 1e9))
    else:
        host_tokens = int(runner.max_total_num_tokens * server_args.hicache_ratio)
    return create_hierarchical_cache(
        runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.page_size, pool,
        host_tokens=host_tokens, write_policy=server_args.hicache_write_policy,
        storage_dir=server_args.hicache_storage_dir, model_path=server_args.model_path,
    )


def choose_loop(
    server_args: ServerArgs, parallel: ParallelState, tp_worker: TpModelWorker,
    is_generation: bool, draft_model: DraftModelProposer | None = None,
) -> Callable[[LoopScheduler], SchedulerLoop]:
    """The one place a scheduler's loop is chosen: ``PipelineLoop`` with ``--pp-size`` > 1,
    ``OverlapLoop`` where ``ServerArgs.overlap_schedule_on`` says so (on CUDA by default,
    on CPU with ``--enable-overlap-schedule``; generation models only: an embedding has no
    decode steps to overlap), else ``NormalLoop``. Returns how to make it for the
    scheduler it drives."""
    timeout = server_args.watchdog_timeout
    info = parallel.info
    if info.pp_size > 1:
        assert parallel.p2p is not None, "pipeline stages talk point to point"
        p2p, device = parallel.p2p, tp_worker.model_runner.device
        return lambda scheduler: PipelineLoop(scheduler, timeout, info, p2p, device)
    if server_args.speculative_algorithm is not None and is_generation:
        standalone = server_args.speculative_algorithm == "STANDALONE"
        assert standalone == (draft_model is not None)
        decoder = SpeculativeDecoder(
            tp_worker,
            None if standalone else NgramProposer(
                server_args.speculative_ngram_min_match_window_size,
                server_args.speculative_ngram_max_match_window_size,
            ),
            server_args.speculative_num_steps if standalone
            else server_args.speculative_num_draft_tokens,
            server_args.speculative_max_batch_size,
            tp_worker.model_runner.model_config.context_len,
            draft_model=draft_model,
        )
        return lambda scheduler: SpeculativeLoop(scheduler, timeout, decoder)
    if server_args.overlap_schedule_on(tp_worker.model_runner.device.type) and is_generation:
        worker = OverlapWorker(tp_worker)
        return lambda scheduler: OverlapLoop(scheduler, timeout, worker)
    return lambda scheduler: NormalLoop(scheduler, timeout)
