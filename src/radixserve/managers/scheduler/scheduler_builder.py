"""Building a ``Scheduler`` for one rank: the model, the prefix cache, grammars, sessions and
the output path, each from the settings it reads (docs/architecture.md §4).

``build_scheduler`` is the one place where the scheduler's side reads ``ServerArgs``. The
``Scheduler`` receives what it composes (``SchedulerParts``) and the few settings its own loop
reads (``SchedulerSettings``): a new setting is wired here, to the component that uses it, and a
test can hand the scheduler parts built another way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from radixserve.constrained import GrammarCache, create_grammar_backend
from radixserve.distributed import ParallelState
from radixserve.managers.scheduler.output_processor import OutputProcessor
from radixserve.managers.scheduler.overlap_worker import OverlapWorker
from radixserve.managers.scheduler.retraction import NewTokenRatio
from radixserve.managers.scheduler.schedule_policy import SchedulePolicy
from radixserve.managers.scheduler.scheduler import Scheduler
from radixserve.managers.scheduler.session_controller import SessionController
from radixserve.managers.scheduler.tp_worker import TpModelWorker
from radixserve.mem_cache import BasePrefixCache, create_prefix_cache, create_session_store
from radixserve.model_config import ModelConfig, resolve_device
from radixserve.model_executor.model_runner import RunnerSettings
from radixserve.server_args import ServerArgs


@dataclass(frozen=True)
class SchedulerSettings:
    """What the scheduler's loop reads itself; ``set_internal_state`` replaces the budgets."""

    max_prefill_tokens: int
    chunked_prefill_size: int
    watchdog_timeout: float


@dataclass
class SchedulerParts:
    """The collaborators one rank's scheduler composes."""

    model_config: ModelConfig
    is_generation: bool  # embedding models (an encoder, or --is-embedding) only prefill
    tp_worker: TpModelWorker
    tree_cache: BasePrefixCache
    grammars: GrammarCache
    sessions: SessionController
    policy: SchedulePolicy
    new_token_ratio: NewTokenRatio
    output_processor: OutputProcessor
    overlap: OverlapWorker | None  # --enable-overlap-schedule


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
    from transformers import AutoTokenizer

    parallel = parallel or ParallelState.single()
    device = device or resolve_device(server_args.device)
    model_config = ModelConfig.from_path(
        server_args.model_path, server_args.dtype, device, server_args.context_length,
        server_args.quantization,
    )
    is_generation = not (server_args.is_embedding or model_config.is_encoder)
    runner_settings = RunnerSettings.from_args(server_args)
    tp_worker = TpModelWorker(model_config, runner_settings, device, parallel)
    runner = tp_worker.model_runner
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
    tree_cache = create_prefix_cache(
        not radix_enabled, runner.req_to_token_pool, runner.token_to_kv_pool_allocator,
        runner.page_size, streaming_sessions=server_args.enable_streaming_session,
        session_store=store, session_offload_after=server_args.session_offload_after,
    )
    # For stop strings and grammars; the detokenizer makes the text.
    tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer, local_files_only=True)
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
    output_processor = OutputProcessor(
        tree_cache,
        model_config.eos_token_ids,
        tokenizer,
        send_to_detokenizer,
        on_finish=sessions.on_req_finished,
        stream_interval=server_args.stream_interval,
        send_to_tokenizer=send_to_tokenizer,
    )
    overlap = None
    if server_args.overlap_schedule_on(device.type) and is_generation:
        overlap = OverlapWorker(tp_worker)
    parts = SchedulerParts(
        model_config=model_config,
        is_generation=is_generation,
        tp_worker=tp_worker,
        tree_cache=tree_cache,
        grammars=grammars,
        sessions=sessions,
        policy=SchedulePolicy(server_args.schedule_policy, tree_cache, radix_enabled),
        new_token_ratio=NewTokenRatio.from_conservativeness(
            server_args.schedule_conservativeness
        ),
        output_processor=output_processor,
        overlap=overlap,
    )
    settings = SchedulerSettings(
        max_prefill_tokens=server_args.max_prefill_tokens,
        chunked_prefill_size=server_args.chunked_prefill_size,
        watchdog_timeout=server_args.watchdog_timeout,
    )
    return Scheduler(parts, settings, send_to_tokenizer, parallel, device, dp_rank, send_load)
