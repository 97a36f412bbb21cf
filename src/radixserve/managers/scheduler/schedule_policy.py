"""Which waiting requests enter the next prefill batch.

``SchedulePolicy`` orders the waiting queue (``fcfs``, or ``lpm``: longest cached prefix first, so
requests sharing a prefix run while it is still cached); with priority scheduling the requests'
priorities come first and that order only breaks ties (``priority_scheduling.py``).
``PrefillAdder`` is built once per step and admits requests in that order while they fit:

- the token budget of one prefill batch (``max_prefill_tokens`` and ``chunked_prefill_size``);
  the request that does not fit the rest of it is cut to a chunk (page aligned), becomes *the*
  chunked request, and continues first in the next step's batch;
- KV memory: free slots plus what the prefix cache could evict, minus a reservation of the tokens
  running (and newly admitted) requests will still decode, scaled by the new-token ratio;
- request rows: a turn that resumes its streaming session's slot takes over the slot's row; any
  other request needs a free row; and at most ``max_running_requests`` requests run.

Eviction itself happens at allocation (``ScheduleBatch.prepare_for_extend``); every admitted
request's prefix is locked first, so that eviction can only take what admission did not count on.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from radixserve.managers.scheduler.priority_scheduling import PriorityScheduling
from radixserve.managers.scheduler.schedule_batch import Req, pages_to_alloc
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

# Beyond this many waiting requests, lpm costs more than it saves: fall back to fcfs.
_LPM_MAX_QUEUE = 128
# Reservations count at most this many remaining tokens per request (long max_new_tokens rarely
# run to the end; retraction covers the rest).
_CLIP_MAX_NEW_TOKENS = 4096


class SchedulePolicy:
    """Orders the waiting queue in place before each admission round."""

    def __init__(
        self, policy: str, tree_cache: BasePrefixCache, radix_enabled: bool,
        priority: PriorityScheduling | None = None,
    ) -> None:
        """``priority``: the priority settings with --enable-priority-scheduling, else None."""
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"unknown schedule policy {policy!r}")
        self.policy = policy
        self.tree_cache = tree_cache
        # Without a radix tree every match is empty, so lpm would be fcfs with extra work.
        self.radix_enabled = radix_enabled
        self.priority = priority

    def calc_priority(self, waiting_queue: list[Req]) -> None:
        self._policy_order(waiting_queue)
        if self.priority is not None:
            self.priority.order(waiting_queue)

    def _policy_order(self, waiting_queue: list[Req]) -> None:
        if self.policy == "fcfs" or not self.radix_enabled or len(waiting_queue) > _LPM_MAX_QUEUE:
            return
        matched = {
            id(req): len(self.tree_cache.match_prefix(req.all_ids[:-1]).device_indices)
            for req in waiting_queue
        }
        # Stable: equal matches keep arrival order.
        waiting_queue.sort(key=lambda r: -matched[id(r)])


def decode_reservation(req: Req, new_token_ratio: float) -> int:
    """Tokens to hold back for the rest of ``req``'s decode."""
    remaining = min(req.remaining_new_tokens(), _CLIP_MAX_NEW_TOKENS)
    return math.ceil(remaining * new_token_ratio)


class AddResult(enum.Enum):
    CONTINUE = enum.auto()  # admitted; try the next request
    STOP = enum.auto()  # budget, memory or slots exhausted (or a chunk was cut): stop this round


class PrefillAdder:
    """Admits requests into one prefill batch; discarded after the step."""

    def __init__(
        self,
        *,
        tree_cache: BasePrefixCache,
        allocator: Any,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        free_rows: int,
        free_running: int,
        allow_chunking: bool = True,
    ) -> None:
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        self.new_token_ratio = new_token_ratio
        self.rem_batch_tokens = min(max_prefill_tokens, chunked_prefill_size)
        self.free_rows = free_rows  # free rows of the request pool
        self.free_running = free_running  # requests that may still join the running set
        # False for encoders: a request is computed whole or waits for the next batch.
        self.allow_chunking = allow_chunking
        self.nothing_running = not running_reqs
        # KV the admitted requests will allocate plus what everyone still decodes.
        self.committed_tokens = sum(decode_reservation(r, new_token_ratio) for r in running_reqs)
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def rem_total_tokens(self) -> int:
        """KV slots still free for this batch: free + reclaimable (unlocked) - committed."""
        return (
            self.allocator.available_size()
            + self.tree_cache.reclaimable_size()
            - self.committed_tokens
        )

    def add_chunked_req(self, req: Req) -> AddResult:
        """Continue the chunked request: its earlier chunks are its prefix, already locked."""
        plan = self._plan(req, len(req.prefix_indices))
        if plan is None:
            return AddResult.STOP
        return self._commit(req, *plan)

    def add_one_req(self, req: Req) -> AddResult:
        """Match ``req``'s cached prefix, lock it, then admit it if it still fits."""
        if self.free_running == 0:
            return AddResult.STOP
        # At least the last token is computed, so the step has logits to sample from (and
        # every position whose logits give the request's input logprobs: ``max_prefix_len``).
        match = self.tree_cache.match_req(req, req.all_ids[: req.max_prefix_len])
        needs_row = match.req_pool_idx is None
        if needs_row and self.free_rows == 0:
            return AddResult.STOP
        # Lock first, then check capacity: the lock turns the prefix from evictable to
        # protected, so the check below cannot count on evicting it.
        self.tree_cache.inc_lock_ref(match.last_node)
        prefix_len = len(match.device_indices)
        plan = self._plan(req, prefix_len)
        if plan is None:
            self.tree_cache.dec_lock_ref(match.last_node)
            return AddResult.STOP
        req.prefix_indices = match.device_indices
        req.last_node = match.last_node
        req.req_pool_idx = match.req_pool_idx
        req.kv_len = prefix_len
        if not req.is_retracted:  # a retracted request matching its own KV reuses nothing
            req.cached_tokens = max(req.cached_tokens, prefix_len)
        self.free_running -= 1
        self.free_rows -= needs_row
        return self._commit(req, *plan)

    def _plan(self, req: Req, prefix_len: int) -> tuple[int, int, bool] | None:
        """``(seq_len, committed tokens, chunked)`` of admitting ``req``, or None if it cannot."""
        total_len = req.seqlen
        if total_len - prefix_len <= self.rem_batch_tokens:
            seq_len, chunked = total_len, False
            reserve = decode_reservation(req, self.new_token_ratio)
        elif not self.allow_chunking:
            return None
        else:
            seq_len = prefix_len + self.rem_batch_tokens // self.page_size * self.page_size
            chunked, reserve = True, 0
        if seq_len <= prefix_len:
            return None
        need = pages_to_alloc(prefix_len, seq_len, self.page_size)
        rem = self.rem_total_tokens()
        # The only request with nothing running: its own reservation is an estimate that must
        # not starve it (retraction and its length limit bound the rest).
        alone = self.nothing_running and not self.can_run
        if need + reserve <= rem or (alone and need <= rem):
            return seq_len, need + reserve, chunked
        return None

    def _commit(self, req: Req, seq_len: int, committed: int, chunked: bool) -> AddResult:
        req.fill_ids = req.all_ids[:seq_len]
        req.extend_input_len = seq_len - req.kv_len
        req.is_chunked = chunked
        self.committed_tokens += committed
        self.rem_batch_tokens -= req.extend_input_len
        self.can_run.append(req)
        if chunked:
            self.new_chunked_req = req
            return AddResult.STOP
        return AddResult.CONTINUE
