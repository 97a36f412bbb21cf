"""The prefill attention dispatch (``layers/attention/extend_dispatch.py``): which kernel attends
each EXTEND request on CPU, per extend and prefix length bucket. The choice logic runs on
injected timings (nothing here is timed), the cache is the linear kernels' real file, which a new
CPU or torch invalidates, and every candidate (and a batch mixing them) is compared with the
``torch_native`` reference on paged batches with cached prefixes."""

from __future__ import annotations

import json

import pytest
import torch

from radixserve.forward_batch import ForwardMode
from radixserve.layers import kernel_dispatch as kd
from radixserve.layers.attention import Attention, create_attention_backend
from radixserve.layers.attention import extend_dispatch as xd
from tests.layers.helpers import require_kernels
from tests.layers.paged_batches import attend, random_batch

IDENTITY = {"cpu_model": "Xeon", "cpu_flags": "f", "torch": "2.x", "threads": "2",
            "kernels": "k"}
BOTH = (xd.NATIVE, xd.SDPA)
SHAPE = xd.Shape(torch.bfloat16, 64, 7, BOTH)


def test_a_request_falls_in_the_smallest_extend_and_prefix_buckets_that_hold_it():
    e = len(xd.EXTEND_BUCKETS)
    assert xd.cell_index(1, 0) == 0 and xd.cell_index(16, 0) == 0 and xd.cell_index(17, 0) == 1
    assert xd.cell_index(100_000, 0) == e - 1
    assert xd.cell_index(16, 1) == e and xd.cell_index(16, 1024) == e
    assert xd.cell_index(5000, 5000) == xd.NUM_CELLS - 1
    assert [xd.cell_sizes(xd.cell_index(*xd.cell_sizes(c))) for c in range(xd.NUM_CELLS)] == [
        xd.cell_sizes(c) for c in range(xd.NUM_CELLS)
    ]


def test_the_static_table_takes_sdpa_only_for_long_bf16_extends_on_amx():
    table = xd.static_table(BOTH, amx_cpu=True, dtype=torch.bfloat16)
    for cell, name in enumerate(table):
        extend, prefix = xd.cell_sizes(cell)
        assert name == (xd.SDPA if extend >= xd.STATIC_SDPA_FROM[prefix > 0] else xd.NATIVE)
    assert xd.SDPA in table and xd.NATIVE in table
    assert set(xd.static_table(BOTH, amx_cpu=False, dtype=torch.bfloat16)) == {xd.NATIVE}
    assert set(xd.static_table(BOTH, amx_cpu=True, dtype=torch.float32)) == {xd.NATIVE}


def test_deterministic_inference_keeps_only_the_batch_invariant_kernel():
    assert xd.allowed_candidates(batch_invariant=True) == (xd.NATIVE,)
    assert xd.allowed_candidates(batch_invariant=False) == BOTH
    only = xd.static_table((xd.NATIVE,), amx_cpu=True, dtype=torch.bfloat16)
    assert set(only) == {xd.NATIVE}
    # one candidate: nothing is measured, the static table stands
    shape = xd.Shape(torch.bfloat16, 64, 7, (xd.NATIVE,))
    assert xd.tune(shape, only, None, measure_fn=lambda *a: pytest.fail("timed")) == only


def timings(sdpa_faster_from_extend: int):
    """A measure_fn: SDPA twice as fast from that extend length up, half as fast below."""
    calls: list[list[int]] = []

    def measure(shape, cells, budget_end):
        calls.append(list(cells))
        seconds = {n: [None] * xd.NUM_CELLS for n in shape.candidates}
        for cell in cells:
            extend, _ = xd.cell_sizes(cell)
            seconds[xd.NATIVE][cell] = 1.0
            seconds[xd.SDPA][cell] = 0.5 if extend >= sdpa_faster_from_extend else 2.0
        return seconds

    return measure, calls


def test_tune_chooses_the_faster_per_cell_and_the_cache_answers_the_next_start(tmp_path):
    static = (xd.NATIVE,) * xd.NUM_CELLS
    measure, calls = timings(sdpa_faster_from_extend=256)
    table = xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=measure)
    # every cell, then the cells that would switch, once more
    assert calls == [list(range(xd.NUM_CELLS)),
                     [c for c in range(xd.NUM_CELLS) if xd.cell_sizes(c)[0] >= 256]]
    for cell, name in enumerate(table):
        assert name == (xd.SDPA if xd.cell_sizes(cell)[0] >= 256 else xd.NATIVE)
    stored = json.loads(kd.DispatchCache(tmp_path, IDENTITY).path.read_text())
    assert set(stored["entries"]) == {SHAPE.key()}
    # what the benchmarks print: the same table read back, or the static one where none is
    assert xd.cached_or_static(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY)) == (
        table, "measured")
    empty = kd.DispatchCache(tmp_path / "none", IDENTITY)
    assert xd.cached_or_static(SHAPE, static, empty) == (static, "static")

    again, calls_again = timings(sdpa_faster_from_extend=0)  # must not be asked
    assert xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again) == table
    assert calls_again == []
    # another head_dim or group is another entry: measured
    other = xd.Shape(torch.bfloat16, 128, 7, BOTH)
    xd.tune(other, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again)
    assert len(calls_again) == 2  # every cell, then the switches once more


@pytest.mark.parametrize("changed", ["cpu_model", "cpu_flags", "torch"])
def test_a_new_cpu_or_torch_measures_attention_again(tmp_path, changed):
    static = (xd.NATIVE,) * xd.NUM_CELLS
    measure, _ = timings(sdpa_faster_from_extend=256)
    xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=measure)
    other = {**IDENTITY, changed: IDENTITY[changed] + "-new"}
    again, calls = timings(sdpa_faster_from_extend=0)
    table = xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, other), measure_fn=again)
    assert calls == [list(range(xd.NUM_CELLS))] * 2 and table == (xd.SDPA,) * xd.NUM_CELLS


def test_a_close_call_keeps_the_static_choice_and_cells_past_the_budget_are_measured_later(
    tmp_path,
):
    static = xd.static_table(BOTH, amx_cpu=True, dtype=torch.bfloat16)

    def partial(shape, cells, budget_end):  # only the first two cells fit, SDPA 3% faster
        seconds = {n: [None] * xd.NUM_CELLS for n in shape.candidates}
        for cell in cells[:2]:
            seconds[xd.NATIVE][cell], seconds[xd.SDPA][cell] = 1.0, 0.97
        return seconds

    cache = kd.DispatchCache(tmp_path, IDENTITY)
    assert xd.tune(SHAPE, static, cache, measure_fn=partial) == static
    measure, calls = timings(sdpa_faster_from_extend=10**6)  # SDPA slower everywhere
    table = xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=measure)
    assert calls[0] == list(range(2, xd.NUM_CELLS))  # the two cached cells are not timed again
    # then the static SDPA cells among them, which switch, once more
    assert calls[1:] == [[c for c in range(2, xd.NUM_CELLS) if static[c] == xd.SDPA]]
    assert table[:2] == static[:2] and table[2:] == (xd.NATIVE,) * (xd.NUM_CELLS - 2)


def test_a_cell_leaves_the_static_table_only_if_its_choice_loses_two_timings(tmp_path):
    static = (xd.NATIVE,) * xd.NUM_CELLS
    calls: list[list[int]] = []

    def slow_once(shape, cells, budget_end):  # native read slow in cell 0 the first time only
        calls.append(list(cells))
        seconds = {n: [None] * xd.NUM_CELLS for n in shape.candidates}
        for cell in cells:
            seconds[xd.NATIVE][cell] = 3.0 if cell == 0 and len(calls) == 1 else 1.0
            seconds[xd.SDPA][cell] = 2.0
        return seconds

    cache = kd.DispatchCache(tmp_path, IDENTITY)
    assert xd.tune(SHAPE, static, cache, measure_fn=slow_once) == static
    assert calls == [list(range(xd.NUM_CELLS)), [0]]
    # the cache holds each candidate's better time: the next start keeps the static choice too
    assert kd.DispatchCache(tmp_path, IDENTITY).get(SHAPE.key())[xd.NATIVE][0] == 1.0


def test_measure_times_every_cell_it_is_given_and_stops_at_the_budget():
    require_kernels()
    shape = xd.Shape(torch.float32, 16, 2, BOTH)
    seconds = xd.measure(shape, [0, 1], float("inf"))
    assert all(seconds[n][c] > 0 for n in BOTH for c in (0, 1))
    assert all(seconds[n][c] is None for n in BOTH for c in range(2, xd.NUM_CELLS))
    assert all(v is None for s in xd.measure(shape, [0], -1.0).values() for v in s)


def _cpu_attend(b, table: tuple[str, ...]) -> torch.Tensor:
    backend = create_attention_backend("cpu", b.req_pool, b.pool)
    backend.extend_table = table
    attn = Attention(b.heads, b.head_dim, b.head_dim**-0.5, b.kv_heads, 0, backend)
    backend.init_forward_metadata(b.fb)
    return attn(b.q, b.k, b.v, b.fb)


TABLES = {
    "native": (xd.NATIVE,) * xd.NUM_CELLS,
    "sdpa": (xd.SDPA,) * xd.NUM_CELLS,
    # fresh prompts take SDPA, prefixed ones the kernel: batches mix both
    "mixed": (xd.SDPA,) * len(xd.EXTEND_BUCKETS)
    + (xd.NATIVE,) * (xd.NUM_CELLS - len(xd.EXTEND_BUCKETS)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (14, 2)])
def test_every_candidate_and_a_mixed_batch_equal_the_torch_native_reference(
    dtype, table, heads, kv_heads
):
    require_kernels()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for seed in range(4):
        def fresh(seed=seed):
            return random_batch(seed, ForwardMode.EXTEND, 4, dtype, heads, kv_heads, 64,
                                max_extend=40, max_prefix=50, max_bs=4)

        b = fresh()
        got = _cpu_attend(b, TABLES[table])
        assert not got.isnan().any()
        # the K/V were written into the pool: the next layer (or request) reads them
        b_ref = fresh()
        want = attend("torch_native", b_ref)
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
        loc = b.fb.out_cache_loc
        assert torch.equal(b.pool.k_buffer[0][loc], b_ref.pool.k_buffer[0][loc])
        assert torch.equal(b.pool.v_buffer[0][loc], b_ref.pool.v_buffer[0][loc])


def test_decode_steps_and_deterministic_backends_never_take_sdpa():
    require_kernels()
    b = random_batch(1, ForwardMode.DECODE, 4, torch.bfloat16, 14, 2, 64)
    got = _cpu_attend(b, TABLES["sdpa"])
    torch.testing.assert_close(got.float(), attend("torch_native", random_batch(
        1, ForwardMode.DECODE, 4, torch.bfloat16, 14, 2, 64)).float(), atol=2e-2, rtol=2e-2)
    b = random_batch(2, ForwardMode.EXTEND, 4, torch.bfloat16, 14, 2, 64)
    backend = create_attention_backend("cpu", b.req_pool, b.pool, batch_invariant=True)
    assert set(backend.choose_extend_kernels(14, "off")) == {xd.NATIVE}


def test_attention_timed_under_load_is_timed_again_at_a_quiet_start(tmp_path):
    from tests.layers.test_kernel_dispatch import FakeLoad

    static = (xd.NATIVE,) * xd.NUM_CELLS
    measure, calls = timings(sdpa_faster_from_extend=256)
    busy = FakeLoad(busy_while_measuring=True, quiet_at_start=False)
    table = xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=measure,
                    load=busy)
    assert len(calls) == 2 and table != static  # the busy timing is used meanwhile
    assert kd.DispatchCache(tmp_path, IDENTITY).busy_keys() == {SHAPE.key()}
    again, calls_again = timings(sdpa_faster_from_extend=0)
    assert xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again,
                   load=FakeLoad(busy_while_measuring=False, quiet_at_start=False)) == table
    assert calls_again == []  # still busy at this start: kept
    quiet = FakeLoad(busy_while_measuring=False, quiet_at_start=True)
    table = xd.tune(SHAPE, static, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again,
                    load=quiet)
    assert calls_again == [list(range(xd.NUM_CELLS))] * 2 and table == (xd.SDPA,) * xd.NUM_CELLS
    assert kd.DispatchCache(tmp_path, IDENTITY).busy_keys() == frozenset()
