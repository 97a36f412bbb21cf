"""Prefill planning: which waiting requests the next prefill batch admits (docs/architecture.md
§4, Admission).

``PrefillPlanner.plan`` orders the waiting queue (``SchedulePolicy``), continues the chunked
request first, and admits with ``PrefillAdder`` while the token budget, the KV memory and the
request rows allow; before that, idle streaming sessions give back request rows and offloaded
sessions of waiting turns are loaded back (``mem_cache``). It returns what changed instead of
writing the scheduler's state: the batch, the waiting queue less what it admitted, and the
chunked request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.managers.scheduler.lora_requests import adapter_fits, assign_slots
from radixserve.managers.scheduler.retraction import NewTokenRatio
from radixserve.managers.scheduler.schedule_batch import BatchResources, Req, ScheduleBatch
from radixserve.managers.scheduler.schedule_policy import (
    AddResult,
    PrefillAdder,
    SchedulePolicy,
    decode_reservation,
)

if TYPE_CHECKING:
    from radixserve.lora.lora_manager import LoRAManager


@dataclass
class PrefillPlan:
    batch: ScheduleBatch | None  # prepared for its extend step; None: nothing admitted
    waiting: list[Req]  # the waiting queue, ordered by the policy, less what was admitted
    chunked_req: Req | None  # the request whose next chunk runs in a later prefill


class PrefillPlanner:
    def __init__(
        self,
        resources: BatchResources,
        policy: SchedulePolicy,
        new_token_ratio: NewTokenRatio,
        allow_chunking: bool,
        lora: LoRAManager | None = None,
    ) -> None:
        """``resources``: the pools and cache the batches use; ``allow_chunking``: False for
        an encoder, whose input is encoded in one step; ``lora``: the adapters, with
        ``--enable-lora``."""
        self.resources = resources
        self.lora = lora
        self.policy = policy
        self.new_token_ratio = new_token_ratio
        self.allow_chunking = allow_chunking

    def plan(
        self,
        waiting: list[Req],
        chunked_req: Req | None,
        running: list[Req],
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
    ) -> PrefillPlan:
        """The next prefill. ``running``: every admitted request but the chunked one, in
        every micro-batch (they count against the limits and hold KV to decode)."""
        tree_cache = self.resources.tree_cache
        allocator = self.resources.allocator
        rows = self.resources.req_to_token_pool
        free_running = max_running_requests - len(running) - (chunked_req is not None)
        if rows.available_size() == 0:
            # Idle sessions must not starve new requests of rows: their KV goes to the store
            # (or is dropped). Give back no more than can be admitted, sparing sessions whose
            # own turn waits (it takes its slot's row over).
            tree_cache.evict_session_rows(
                min(len(waiting), free_running),
                spare={r.streaming_session_id for r in waiting},
            )
        # Offloaded sessions of waiting turns come back first, within what admission could
        # give them: free and reclaimable KV less what running requests will still decode.
        reserved = sum(decode_reservation(r, self.new_token_ratio.value) for r in running)
        tree_cache.load_back(
            waiting,
            allocator.available_size() + tree_cache.reclaimable_size() - reserved,
            min(rows.available_size(), free_running),
        )
        adder = PrefillAdder(
            tree_cache=tree_cache,
            allocator=allocator,
            running_reqs=running,
            new_token_ratio=self.new_token_ratio.value,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            free_rows=rows.available_size(),
            free_running=free_running,
            allow_chunking=self.allow_chunking,
        )
        if chunked_req is not None:
            if adder.add_chunked_req(chunked_req) is AddResult.CONTINUE:
                chunked_req = None  # its last chunk runs now
        if chunked_req is None:
            self.policy.calc_priority(waiting)
            adapters = {r.lora_path for r in (*running, *adder.can_run) if r.lora_path}
            for req in waiting:
                if self.lora is not None and not adapter_fits(
                    req, adapters, self.lora.settings.max_loras_per_batch
                ):
                    continue  # its adapter waits for a slot; later requests may fit
                result = adder.add_one_req(req)
                if req.lora_path is not None and adder.can_run and adder.can_run[-1] is req:
                    adapters.add(req.lora_path)
                if result is AddResult.STOP:
                    break
            if adder.new_chunked_req is not None:
                chunked_req = adder.new_chunked_req
        if not adder.can_run:
            return PrefillPlan(None, waiting, chunked_req)
        admitted = {id(r) for r in adder.can_run}
        waiting = [r for r in waiting if id(r) not in admitted]
        if self.lora is not None:
            assign_slots(self.lora, [*running, *adder.can_run])
        batch = ScheduleBatch(adder.can_run, self.resources)
        batch.prepare_for_extend()
        return PrefillPlan(batch, waiting, chunked_req)
