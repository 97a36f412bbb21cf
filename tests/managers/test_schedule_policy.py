"""Admission, ordering and retraction on real pools and a real radix tree (no model needed)."""

from __future__ import annotations

import pytest
import torch

from radixserve.managers.scheduler.retraction import NewTokenRatio, retract_for_decode
from radixserve.managers.scheduler.schedule_batch import BatchResources, Req, ScheduleBatch
from radixserve.managers.scheduler.schedule_policy import AddResult, PrefillAdder, SchedulePolicy
from radixserve.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.sampling.sampling_params import SamplingParams


class Pools:
    def __init__(self, kv_tokens: int = 64, slots: int = 8, page_size: int = 1,
                 decode_run: int = 1) -> None:
        self.req_to_token = ReqToTokenPool(slots, 256, "cpu")
        self.allocator = TokenToKVPoolAllocator(kv_tokens, page_size, "cpu", decode_run)
        self.cache = RadixCache(self.req_to_token, self.allocator, page_size)
        self.res = BatchResources(self.req_to_token, self.allocator, self.cache,
                                  torch.device("cpu"), 512, [1])

    def cache_tokens(self, ids: list[int]) -> None:
        """Put ``ids`` into the tree as an unlocked (evictable) entry."""
        self.cache.insert(ids, self.allocator.alloc(len(ids)))

    def adder(self, running: list[Req] = (), ratio: float = 1.0, budget: int = 1024,
              slots: int = 8) -> PrefillAdder:
        return PrefillAdder(tree_cache=self.cache, allocator=self.allocator,
                            running_reqs=list(running), new_token_ratio=ratio,
                            max_prefill_tokens=budget, chunked_prefill_size=budget,
                            free_rows=slots, free_running=slots)


def req(rid: str, ids: list[int], max_new_tokens: int = 1) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))


def test_lpm_puts_longest_cached_prefix_first_and_fcfs_keeps_arrival_order():
    pools = Pools()
    pools.cache_tokens(list(range(10, 30)))
    waiting = [req("none", [5, 6, 7]), req("some", list(range(10, 20)) + [99]),
               req("most", list(range(10, 30)) + [99])]
    fcfs = list(waiting)
    SchedulePolicy("fcfs", pools.cache, radix_enabled=True).calc_priority(fcfs)
    assert [r.rid for r in fcfs] == ["none", "some", "most"]
    SchedulePolicy("lpm", pools.cache, radix_enabled=True).calc_priority(waiting)
    assert [r.rid for r in waiting] == ["most", "some", "none"]


def test_adder_chunks_the_request_that_overflows_the_budget_and_stops():
    pools = Pools()
    adder = pools.adder(budget=16)
    first, second, third = req("a", list(range(6, 16))), req("b", list(range(6, 36))), req("c", [7])
    assert adder.add_one_req(first) is AddResult.CONTINUE
    assert adder.add_one_req(second) is AddResult.STOP
    assert adder.new_chunked_req is second and second.is_chunked
    assert second.extend_input_len == 6 and len(second.fill_ids) == 6
    assert not first.is_chunked and first.extend_input_len == 10
    assert adder.can_run == [first, second]
    assert third.fill_ids == []


def test_adder_reserves_what_running_requests_will_still_decode():
    pools = Pools(kv_tokens=64)
    running = [req("r", [6], max_new_tokens=40)]
    assert pools.adder(running, ratio=1.0).add_one_req(req("x", list(range(6, 36)))) is (
        AddResult.STOP
    )
    assert pools.adder(running, ratio=0.5).add_one_req(req("y", list(range(6, 36)))) is (
        AddResult.CONTINUE
    )


def test_adder_does_not_count_on_evicting_the_prefix_it_reuses():
    pools = Pools(kv_tokens=64)
    prefix = list(range(6, 46))
    pools.cache_tokens(prefix)  # 40 evictable, 24 free
    r = req("x", prefix + list(range(100, 130)))
    # Before the lock the tree looked evictable (24 + 40 >= 30), but it is this request's prefix.
    assert pools.adder().add_one_req(r) is AddResult.STOP
    assert pools.cache.protected_size() == 0, "a refused request must release its lock"
    assert pools.cache.evictable_size() == 40
    assert len(r.prefix_indices) == 0 and r.last_node is None


def test_adder_reuses_cached_prefix_and_reports_it():
    pools = Pools(kv_tokens=64)
    prefix = list(range(6, 46))
    pools.cache_tokens(prefix)
    r = req("x", prefix + [100, 101])
    assert pools.adder().add_one_req(r) is AddResult.CONTINUE
    assert r.cached_tokens == 40 and r.extend_input_len == 2
    assert pools.cache.protected_size() == 40
    pools.cache.dec_lock_ref(r.last_node)


def test_adder_stops_at_the_request_slot_limit():
    pools = Pools()
    adder = pools.adder(slots=2)
    results = [adder.add_one_req(req(f"r{i}", [6 + i, 7])) for i in range(3)]
    assert results == [AddResult.CONTINUE, AddResult.CONTINUE, AddResult.STOP]


def test_adder_admits_a_lone_request_whose_reservation_alone_does_not_fit():
    pools = Pools(kv_tokens=64)
    assert pools.adder().add_one_req(req("big", list(range(6, 56)), 100)) is AddResult.CONTINUE


def _running_batch(pools: Pools, lens: list[int], max_new: list[int],
                   decode_steps: int = 0) -> ScheduleBatch:
    """Prefill distinct prompts and decode a few steps for real (pools only, no model)."""
    reqs = [req(f"r{i}", list(range(10 + 50 * i, 10 + 50 * i + n)), m)
            for i, (n, m) in enumerate(zip(lens, max_new, strict=True))]
    adder = pools.adder(ratio=0.0)  # admit all; the test is about decode running short
    for r in reqs:
        assert adder.add_one_req(r) is AddResult.CONTINUE
    batch = ScheduleBatch(reqs, pools.res)
    batch.prepare_for_extend()
    for r in reqs:
        r.output_ids.append(7)
        pools.cache.cache_unfinished_req(r, r.fill_ids)
    for _ in range(decode_steps):
        batch.prepare_for_decode()
        for r in reqs:
            r.output_ids.append(8)
    return batch


def _exhaust(allocator: TokenToKVPoolAllocator) -> None:
    allocator.alloc_extend([0], [allocator.available_size()], [-1])


def test_decode_steps_give_each_request_its_own_run_of_slots():
    """A host-memory pool (decode runs): the scheduler hands each request's last slot to the
    allocator, and a request's decoded tokens come in runs, not interleaved with the batch's."""
    pools = Pools(kv_tokens=512, decode_run=8)
    batch = _running_batch(pools, [5, 6, 7], [20, 20, 20], decode_steps=12)
    table = pools.req_to_token.req_to_token
    for r in batch.reqs:
        row = table[r.req_pool_idx, r.kv_len - 12 : r.kv_len]  # the decoded tokens' slots
        assert (row[1:] - row[:-1]).tolist().count(1) == 10  # runs of 8 and 4


@pytest.mark.parametrize("page_size,decode_run", [(1, 1), (4, 1), (1, 8)])
def test_retraction_frees_room_for_decode_taking_longest_remaining_first(page_size, decode_run):
    pools = Pools(kv_tokens=64, page_size=page_size, decode_run=decode_run)
    batch = _running_batch(pools, [8, 8, 8], [10, 30, 12], decode_steps=4)
    _exhaust(pools.allocator)
    assert batch.decode_tokens_needed() > pools.cache.evictable_size()
    ratio = NewTokenRatio.from_conservativeness(1.0)
    before = ratio.value
    result = retract_for_decode(batch, ratio)
    assert result.retracted and result.retracted[0].rid == "r1"  # most remaining tokens
    assert not result.cannot_fit
    for r in result.retracted:
        assert r.req_pool_idx is None and r.kv_len == 0 and r.is_retracted
        assert r.output_ids == [7, 8, 8, 8, 8], "retraction keeps the output"
    assert "r0" in [r.rid for r in batch.reqs]
    capacity = pools.allocator.available_size() + pools.cache.evictable_size()
    assert batch.decode_tokens_needed() <= capacity
    assert ratio.value >= before


def test_retraction_reports_the_last_request_that_cannot_fit_alone():
    pools = Pools(kv_tokens=16)
    batch = _running_batch(pools, [15], [40])
    _exhaust(pools.allocator)
    result = retract_for_decode(batch, NewTokenRatio.from_conservativeness(1.0))
    assert [r.rid for r in result.cannot_fit] == ["r0"] and not result.retracted
    assert batch.is_empty() and result.cannot_fit[0].req_pool_idx is None


def test_last_request_of_a_micro_batch_waits_while_other_micro_batches_hold_kv():
    """Pipeline parallelism: the pool is full of another micro-batch's requests, so this
    micro-batch's only request goes back to the queue instead of failing."""
    pools = Pools(kv_tokens=16)
    batch = _running_batch(pools, [15], [40])
    _exhaust(pools.allocator)
    result = retract_for_decode(batch, NewTokenRatio.from_conservativeness(1.0),
                                others_hold_kv=True)
    assert [r.rid for r in result.retracted] == ["r0"] and not result.cannot_fit
    assert batch.is_empty() and result.retracted[0].is_retracted
    assert result.retracted[0].output_ids == [7], "retraction keeps the output"
