"""What ``build_scheduler`` hands the ``Scheduler``: its collaborators and the settings its own
code reads (kept apart from the builder so that the scheduler never imports its builder)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from radixserve.constrained import GrammarCache
from radixserve.managers.scheduler.output_processor import OutputProcessor
from radixserve.managers.scheduler.prefill_planner import PrefillPlanner
from radixserve.managers.scheduler.priority_scheduling import PriorityScheduling
from radixserve.managers.scheduler.request_validation import RequestLimits
from radixserve.managers.scheduler.retraction import NewTokenRatio
from radixserve.managers.scheduler.schedule_batch import BatchResources
from radixserve.managers.scheduler.session_controller import SessionController
from radixserve.managers.scheduler.tp_worker import TpModelWorker
from radixserve.mem_cache import BasePrefixCache
from radixserve.model_config import ModelConfig


@dataclass(frozen=True)
class SchedulerSettings:
    """What the scheduler's loop reads itself; ``set_internal_state`` replaces the budgets."""

    max_prefill_tokens: int
    chunked_prefill_size: int
    watchdog_timeout: float
    waiting_timeout: float = 0.0  # RADIXSERVE_REQ_WAITING_TIMEOUT; <= 0: none
    grammar_timeout: float = math.inf  # RADIXSERVE_GRAMMAR_TIMEOUT (constrained/limits.py)


@dataclass
class SchedulerParts:
    """The collaborators one rank's scheduler composes."""

    model_config: ModelConfig
    is_generation: bool  # embedding models (an encoder, or --is-embedding) only prefill
    tp_worker: TpModelWorker
    tree_cache: BasePrefixCache
    grammars: GrammarCache
    sessions: SessionController
    batch_resources: BatchResources  # the pools, cache and device every batch uses
    new_token_ratio: NewTokenRatio  # shared by the planner and the decode steps
    prefill_planner: PrefillPlanner
    limits: RequestLimits  # what a new request is checked against
    output_processor: OutputProcessor
    priority: PriorityScheduling | None = None  # with --enable-priority-scheduling
