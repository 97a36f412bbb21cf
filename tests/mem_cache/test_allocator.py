"""TokenToKVPoolAllocator: accounting, all-or-nothing, partial pages, page 0, double free."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.mem_cache import TokenToKVPoolAllocator
from radixserve.mem_cache.allocator import MAX_QUEUED_FREES, PARK_HEADROOM
from tests.mem_cache.asserters import assert_no_overlap, assert_pages_accounted

PAGE_SIZES = [1, 16]


def test_rejects_size_that_is_not_whole_pages():
    with pytest.raises(ValueError, match="multiple of page_size"):
        TokenToKVPoolAllocator(size=40, page_size=16, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        TokenToKVPoolAllocator(size=40, page_size=0, device="cpu")


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_alloc_and_free_keep_available_size_exact(ps):
    alloc = TokenToKVPoolAllocator(size=8 * ps, page_size=ps, device="cpu")
    assert alloc.available_size() == 8 * ps
    a = alloc.alloc_extend([0, 0], [3 * ps, 2 * ps], [-1, -1])
    assert a is not None and len(a) == 5 * ps and a.dtype == torch.int64
    assert alloc.available_size() == 3 * ps
    alloc.free(a[: 3 * ps])
    assert alloc.available_size() == 6 * ps
    alloc.free(a[3 * ps :])
    assert alloc.available_size() == 8 * ps
    assert_pages_accounted(alloc, [])


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_freed_pages_come_back_after_the_free_list_in_order_and_a_free_copies_nothing(ps):
    alloc = TokenToKVPoolAllocator(size=64 * ps, page_size=ps, device="cpu")
    first = alloc.alloc_extend([0], [10 * ps], [-1])  # pages 1..10
    assert first is not None
    head = alloc._free_pages.data_ptr()
    alloc.free(first[5 * ps : 7 * ps])  # pages 6, 7
    alloc.free(first[2 * ps : 3 * ps])  # page 3
    # the free list (pages 11..64) was not copied to append them: a pool sized by memory holds
    # millions of slots, and every finished or evicted request frees
    assert alloc._free_pages.data_ptr() == head
    assert alloc.available_size() == 57 * ps
    rest = alloc.alloc_extend([0], [54 * ps], [-1])
    assert rest is not None and (rest[::ps] // ps).tolist() == list(range(11, 65))
    again = alloc.alloc_extend([0], [3 * ps], [-1])
    assert again is not None and (again[::ps] // ps).tolist() == [6, 7, 3]
    assert alloc.alloc_extend([0], [1], [-1]) is None
    alloc.free(torch.cat([rest, again]))
    assert alloc.available_size() == 57 * ps
    assert_pages_accounted(alloc, [first[: 2 * ps], first[3 * ps : 5 * ps], first[7 * ps :]])


def test_queued_frees_join_the_free_list_after_a_bounded_number_of_frees():
    # a pool the free list takes long to run through must not queue one tensor per free forever
    alloc = TokenToKVPoolAllocator(size=4 * MAX_QUEUED_FREES, page_size=1, device="cpu")
    taken = alloc.alloc(MAX_QUEUED_FREES)
    assert taken is not None
    for slot in taken[: MAX_QUEUED_FREES - 1]:
        alloc.free(slot.view(1))
    assert len(alloc._released) == MAX_QUEUED_FREES - 1
    alloc.free(taken[-1:])
    assert alloc._released == [] and len(alloc._free_pages) == 4 * MAX_QUEUED_FREES
    assert alloc._free_pages[3 * MAX_QUEUED_FREES :].tolist() == taken.tolist()
    assert_pages_accounted(alloc, [])


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_page_zero_is_never_handed_out(ps):
    alloc = TokenToKVPoolAllocator(size=6 * ps, page_size=ps, device="cpu")
    slots = alloc.alloc_extend([0], [6 * ps], [-1])
    assert slots is not None
    assert int(slots.min()) >= ps
    assert sorted((slots // ps).unique().tolist()) == list(range(1, 7))
    assert alloc.alloc_extend([0], [1], [-1]) is None


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_not_enough_pages_allocates_nothing(ps):
    alloc = TokenToKVPoolAllocator(size=4 * ps, page_size=ps, device="cpu")
    assert alloc.alloc_extend([0, 0], [2 * ps, 2 * ps + 1], [-1, -1]) is None
    assert alloc.available_size() == 4 * ps
    held = alloc.alloc_decode([1] * 4, [-1] * 4)
    assert held is not None
    assert alloc.alloc_decode([1], [-1]) is None
    assert alloc.available_size() == 0
    assert_pages_accounted(alloc, [held])


def test_alloc_n_hands_out_distinct_slots_with_page_size_one():
    alloc = TokenToKVPoolAllocator(size=10, page_size=1, device="cpu")
    a, b = alloc.alloc(4), alloc.alloc(6)
    assert a is not None and b is not None
    assert_no_overlap(a, b)
    assert alloc.alloc(1) is None
    assert sorted(torch.cat((a, b)).tolist()) == list(range(1, 11))


def test_extend_continues_the_partial_last_page_before_taking_a_new_one():
    ps = 16
    alloc = TokenToKVPoolAllocator(size=4 * ps, page_size=ps, device="cpu")
    first = alloc.alloc_extend([0], [5], [-1])
    assert first is not None
    page = int(first[0]) // ps
    assert first.tolist() == [page * ps + i for i in range(5)]
    assert alloc.available_size() == 3 * ps

    second = alloc.alloc_extend([5], [20], [int(first[-1])])
    assert second is not None and len(second) == 15
    assert second[:11].tolist() == [page * ps + i for i in range(5, 16)]
    new_page = int(second[11]) // ps
    assert new_page != page and second[11:].tolist() == [new_page * ps + i for i in range(4)]
    assert alloc.available_size() == 2 * ps

    # Decode fills the same page until it is full, then opens a new one.
    last = int(second[-1])
    for seq_len in range(21, 33):
        slot = alloc.alloc_decode([seq_len], [last])
        assert slot is not None and int(slot) == last + 1
        last = int(slot)
    assert alloc.available_size() == 2 * ps
    slot = alloc.alloc_decode([33], [last])
    assert slot is not None and int(slot) % ps == 0 and int(slot) // ps not in (page, new_page)
    assert alloc.available_size() == ps


def test_extend_of_a_batch_mixes_continuations_and_fresh_requests():
    ps = 4
    alloc = TokenToKVPoolAllocator(size=8 * ps, page_size=ps, device="cpu")
    a = alloc.alloc_extend([0], [6], [-1])  # 2 pages, second half full
    assert a is not None
    out = alloc.alloc_extend([6, 0, 8], [9, 3, 8], [int(a[-1]), -1, int(a[-1]) + 2])
    assert out is not None and len(out) == 3 + 3 + 0
    assert out[:2].tolist() == [int(a[-1]) + 1, int(a[-1]) + 2]  # rest of a's page
    assert int(out[2]) % ps == 0  # then a new page
    assert int(out[3]) % ps == 0 and out[3:6].tolist() == [int(out[3]) + i for i in range(3)]
    assert alloc.available_size() == (8 - 2 - 1 - 1) * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_of_a_partial_page_returns_the_whole_page(ps):
    alloc = TokenToKVPoolAllocator(size=2 * ps, page_size=ps, device="cpu")
    slots = alloc.alloc_extend([0], [ps + 1], [-1])
    assert slots is not None and alloc.available_size() == 0
    alloc.free(slots[ps:])  # one slot, alone in its page
    assert alloc.available_size() == ps
    alloc.free(slots[:1])  # one slot of a full page frees the page
    assert alloc.available_size() == 2 * ps
    assert_pages_accounted(alloc, [])


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_double_free_is_caught(ps):
    alloc = TokenToKVPoolAllocator(size=4 * ps, page_size=ps, device="cpu")
    slots = alloc.alloc_extend([0], [2 * ps], [-1])
    assert slots is not None
    alloc.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots[:1])
    assert alloc.available_size() == 4 * ps


def test_freeing_the_padding_page_is_caught():
    alloc = TokenToKVPoolAllocator(size=8, page_size=4, device="cpu")
    with pytest.raises(AssertionError, match="page 0 is padding"):
        alloc.free(torch.tensor([2]))


def _decode_steps(alloc, reqs, steps):
    """``steps`` decode steps of every request in ``reqs`` (lists of slots, grown in place)."""
    for _ in range(steps):
        out = alloc.alloc_decode([len(r) + 1 for r in reqs], [r[-1] for r in reqs])
        assert out is not None
        for r, slot in zip(reqs, out.tolist(), strict=True):
            r.append(slot)


def test_decode_runs_keep_a_requests_generated_tokens_together():
    """Four requests prefilled back to back, then decoded together: with decode runs each
    request's new tokens lie in runs of consecutive slots, not interleaved with the others'."""
    alloc = TokenToKVPoolAllocator(size=1024, page_size=1, device="cpu", decode_run=8)
    reqs = [alloc.alloc_extend([0], [10], [-1]).tolist() for _ in range(4)]
    _decode_steps(alloc, reqs, 20)
    for r in reqs:
        generated = r[10:]
        breaks = sum(b != a + 1 for a, b in zip(generated[:-1], generated[1:], strict=True))
        assert breaks == 2  # 20 tokens: runs of 8, 8 and 4
    # parked slots stay free: the pool counts them, and the rest of the last runs is parked
    held = sum(len(r) for r in reqs)
    assert alloc.available_size() == 1024 - held
    assert alloc._num_parked == 4 * 4
    assert_pages_accounted(alloc, [torch.tensor(r) for r in reqs])

    plain = TokenToKVPoolAllocator(size=1024, page_size=1, device="cpu")
    reqs = [plain.alloc_extend([0], [10], [-1]).tolist() for _ in range(4)]
    _decode_steps(plain, reqs, 20)
    # without runs: a request's next token is the batch size (4) further on
    assert all(b == a + 4 for r in reqs for a, b in zip(r[10:-1], r[11:], strict=True))


def test_parked_slots_rejoin_the_free_list_when_it_runs_short():
    run = 8
    size = PARK_HEADROOM * 2 * run + 2
    alloc = TokenToKVPoolAllocator(size=size, page_size=1, device="cpu", decode_run=run)
    reqs = [alloc.alloc_extend([0], [1], [-1]).tolist() for _ in range(2)]
    _decode_steps(alloc, reqs, 1)  # both start runs: 2 x 7 slots parked
    assert alloc._num_parked == 2 * (run - 1)
    free = alloc.available_size()
    assert free == size - 4
    assert alloc.alloc_extend([0], [free + 1], [-1]) is None  # all or nothing
    assert alloc.available_size() == free and alloc._num_parked == 2 * (run - 1)
    everything = alloc.alloc_extend([0], [free], [-1])  # takes the parked slots too
    assert everything is not None and alloc.available_size() == 0 and alloc._num_parked == 0
    assert alloc.alloc_decode([3, 3], [r[-1] for r in reqs]) is None
    alloc.free(everything)
    assert_pages_accounted(alloc, [torch.tensor(r) for r in reqs])
    # a nearly full pool parks nothing: each decode slot is a single slot, as without runs
    hog = alloc.alloc_extend([0], [alloc.available_size() - 4], [-1])
    _decode_steps(alloc, reqs, 2)
    assert alloc._num_parked == 0 and alloc.available_size() == 0
    assert_pages_accounted(alloc, [torch.tensor(r) for r in reqs] + [hog])


def test_decode_runs_need_page_size_one():
    with pytest.raises(ValueError, match="decode_run"):
        TokenToKVPoolAllocator(size=64, page_size=16, device="cpu", decode_run=8)


def test_clear_frees_everything():
    alloc = TokenToKVPoolAllocator(size=32, page_size=4, device="cpu")
    assert alloc.alloc_extend([0], [30], [-1]) is not None
    alloc.clear()
    assert alloc.available_size() == 32
    assert_pages_accounted(alloc, [])


# No deadline, no speed health check: a loaded machine is slow, not wrong.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ps_run=st.sampled_from([(1, 1), (2, 1), (4, 1), (1, 2), (1, 3)]),
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "extend", "decode", "free"]), st.integers(0, 9)),
        max_size=40,
    ),
)
def test_random_request_traffic_never_shares_a_page(ps_run, ops):
    """Requests grow by extend/decode and finish at random; pages stay exclusive and counted
    (with decode runs too: parked slots are free, never owned)."""
    ps, run = ps_run
    alloc = TokenToKVPoolAllocator(size=12 * ps, page_size=ps, device="cpu", decode_run=run)
    reqs: list[torch.Tensor] = []  # each request's slots, in position order
    for op, n in ops:
        before = alloc.available_size()
        if op == "new":
            out = alloc.alloc_extend([0], [n], [-1])
            if out is not None:
                reqs.append(out)
        elif op in ("extend", "decode") and reqs:
            i = n % len(reqs)
            slots = reqs[i]
            last = int(slots[-1]) if len(slots) else -1
            if op == "extend":
                out = alloc.alloc_extend([len(slots)], [len(slots) + n], [last])
            else:
                out = alloc.alloc_decode([len(slots) + 1], [last])
            if out is not None:
                reqs[i] = torch.cat((slots, out))
        elif op == "free" and reqs:
            alloc.free(reqs.pop(n % len(reqs)))
        else:
            continue
        if op != "free" and out is None:
            assert alloc.available_size() == before, "a failed allocation took pages"
        for slots in reqs:  # position p sits at offset p % ps of the page its page-start opened
            pos = torch.arange(len(slots))
            assert torch.equal(slots % ps, pos % ps)
            assert torch.equal(slots, slots[pos // ps * ps] + pos % ps)
        assert_no_overlap(*reqs)
        assert_pages_accounted(alloc, reqs)
        used = sum(-(-len(s) // ps) for s in reqs)
        assert alloc.available_size() == (12 - used) * ps
