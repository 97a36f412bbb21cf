"""The kernel dispatch (``layers/kernel_dispatch.py``): which kernel runs each linear weight per
batch-row bucket. The choice logic runs on injected timings (nothing here is timed), the cache
is a real file that a new CPU, torch or thread count invalidates, and every candidate kernel is
compared with the native reference at batch sizes of every bucket."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers import kernel_dispatch as kd
from radixserve.layers.custom_op import build_context
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.packed_weight import CpuPackedWeight, prepack_model
from radixserve.layers.quantization.int8 import CpuInt8Weight, Int8Weight, quantize_int8
from radixserve.server_args import ServerArgs
from tests.layers.helpers import (
    HAS_AMX,
    bf16_close,
    require_kernels,
    require_linear_kernel,
    require_ops,
)

BUCKETS = len(kd.ROW_BUCKETS)


def test_a_batch_runs_the_smallest_bucket_that_holds_it():
    assert [kd.bucket_index(m) for m in (0, 1, 2, 3, 4, 5, 32, 33, 64, 65, 512, 513, 10**5)] == [
        0, 0, 1, 2, 2, 3, 5, 6, 6, 7, 9, 9, 9]
    assert kd.describe(("amx",) * 6 + ("onednn",) * 4) == "1-32 amx, 64-512+ onednn"
    assert kd.describe(("blocked",) + ("onednn",) * 9) == "1 blocked, 2-512+ onednn"


def test_the_static_table_follows_the_cpu_and_the_weight():
    amx = kd.static_table((kd.BLOCKED, kd.AMX, kd.ONEDNN), amx_cpu=True, bf16=True)
    assert amx == (kd.AMX,) * 6 + (kd.ONEDNN,) * 4
    # a bf16 shape the AMX kernel cannot take: blocked while small, oneDNN's AMX GEMM when large
    odd = kd.static_table((kd.BLOCKED, kd.ONEDNN), amx_cpu=True, bf16=True)
    assert odd == (kd.BLOCKED,) * 6 + (kd.ONEDNN,) * 4
    # AVX-512 without AMX, and float32 anywhere: the blocked kernel everywhere
    assert kd.static_table((kd.BLOCKED, kd.ONEDNN), amx_cpu=False, bf16=True) == (
        kd.BLOCKED,) * BUCKETS
    assert kd.static_table((kd.BLOCKED, kd.ONEDNN), amx_cpu=True, bf16=False) == (
        kd.BLOCKED,) * BUCKETS
    assert kd.static_table((kd.INT8_VNNI, kd.INT8_DEQUANT), amx_cpu=True, bf16=False) == (
        kd.INT8_VNNI,) * BUCKETS


def test_deterministic_inference_keeps_only_batch_invariant_candidates():
    names = (kd.BLOCKED, kd.AMX, kd.ONEDNN, kd.INT8_VNNI, kd.INT8_DEQUANT)
    assert kd.allowed_candidates(names, batch_invariant=True) == (kd.BLOCKED, kd.INT8_VNNI)
    assert kd.allowed_candidates(names, batch_invariant=False) == names


def test_the_fastest_candidate_wins_each_bucket_unless_within_the_margin_of_the_static_one():
    static = (kd.AMX,) * 6 + (kd.ONEDNN,) * 4
    seconds = {
        # blocked: fastest at 1 and 2 rows (by far), then slower
        kd.BLOCKED: [1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 9.0, 9.0, 9.0, 9.0],
        kd.AMX: [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, None, None, None, None],
        # oneDNN: 3% faster than AMX at 16 rows (kept: AMX is static), 20% at 32 (switch)
        kd.ONEDNN: [3.0, 3.0, 3.0, 3.0, 1.94, 1.6, 1.0, 1.0, 1.0, 1.0],
    }
    assert kd.choose(seconds, static) == (
        kd.BLOCKED, kd.BLOCKED, kd.AMX, kd.AMX, kd.AMX, kd.ONEDNN,
        kd.ONEDNN, kd.ONEDNN, kd.ONEDNN, kd.ONEDNN)
    # a bucket nobody measured keeps the static choice
    assert kd.choose({kd.BLOCKED: [None] * BUCKETS}, static) == static


class FakeWeight:
    """A ``Dispatched`` weight without kernels, for the tuning loop."""

    def __init__(self, n: int, k: int, candidates=(kd.BLOCKED, kd.ONEDNN)) -> None:
        self.weight = torch.zeros(n, k)
        self.candidates = candidates
        self.activation_dtype = torch.bfloat16
        self.table: tuple[str, ...] = self.static()

    def kind(self) -> str:
        return "bf16"

    def static(self) -> tuple[str, ...]:
        return kd.static_table(self.candidates, amx_cpu=False, bf16=True)

    def set_table(self, table) -> None:
        self.table = tuple(table)

    def timing_proxy(self, max_out: int) -> FakeWeight:
        return self

    def kernels(self) -> dict:
        def never(x, bias):
            raise AssertionError("a fake weight's kernel ran: the timing is injected")

        return {name: never for name in (kd.BLOCKED, kd.AMX, kd.ONEDNN)}


def timings(fast_from: int):
    """A measurement where oneDNN wins from bucket ``fast_from`` on; counts its calls."""
    calls = []

    def measure(weight, budget_end):
        calls.append(kd.shape_key(weight))
        return {kd.BLOCKED: [1.0] * BUCKETS,
                kd.ONEDNN: [2.0] * fast_from + [0.5] * (BUCKETS - fast_from)}

    return measure, calls


IDENTITY = {"cpu_model": "Xeon", "cpu_flags": "f", "torch": "2.x", "threads": "2",
            "kernels": "k", "onednn": "", "method": kd.MEASURE_METHOD}


def scripted(readings: dict[int, list[dict[str, float]]]):
    """A ``time_fn`` giving, for a batch of ``rows``, the next of ``readings[rows]`` (the same
    for every candidate where none is left); records the rows of each timing."""
    asked: list[int] = []

    def time_fn(kernels, x):
        rows = x.shape[0]
        asked.append(rows)
        left = readings.get(rows, [])
        reading = left.pop(0) if left else {kd.BLOCKED: 1.0, kd.ONEDNN: 1.0}
        assert set(reading) == set(kernels)
        return reading

    return time_fn, asked


def test_a_bucket_leaves_the_static_table_only_if_its_choice_loses_two_timings():
    # one row: blocked (static) read slow once, then as fast as ever: timed twice, kept
    # 64 rows: oneDNN faster both times: timed twice, switched; elsewhere a tie: timed once
    time_fn, asked = scripted({
        1: [{kd.BLOCKED: 0.66, kd.ONEDNN: 0.60}, {kd.BLOCKED: 0.33, kd.ONEDNN: 0.62}],
        64: [{kd.BLOCKED: 4.0, kd.ONEDNN: 2.0}, {kd.BLOCKED: 3.8, kd.ONEDNN: 2.1}],
    })
    weight = FakeWeight(64, 32)
    seconds = kd.measure(weight, time_fn=time_fn)
    assert asked == [*kd.ROW_BUCKETS, 1, 64]  # the sweep, then the two would-be switches
    assert seconds[kd.BLOCKED][0] == 0.33 and seconds[kd.ONEDNN][0] == 0.60  # best of two
    assert seconds[kd.BLOCKED][6] == 3.8 and seconds[kd.ONEDNN][6] == 2.0
    expected = [kd.BLOCKED] * BUCKETS
    expected[6] = kd.ONEDNN
    assert kd.choose(seconds, weight.static()) == tuple(expected)
    # nothing would switch: one timing per bucket
    quiet_fn, quiet_asked = scripted({})
    kd.measure(weight, time_fn=quiet_fn)
    assert quiet_asked == list(kd.ROW_BUCKETS)


def test_the_budget_cuts_the_sweep_not_the_second_timings(monkeypatch):
    clock = [0.0]  # the budget's clock: one second per timing
    monkeypatch.setattr(kd, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def ticking(readings):
        time_fn, asked = scripted(readings)

        def tick(kernels, x):
            clock[0] += 1.0
            return time_fn(kernels, x)

        return tick, asked

    def slow_once():  # the blocked kernel slow at one row the first time
        return {1: [{kd.BLOCKED: 0.66, kd.ONEDNN: 0.60}, {kd.BLOCKED: 0.33, kd.ONEDNN: 0.62}]}

    # the sweep ends past the budget, and the would-be switch at one row is timed again anyway
    time_fn, asked = ticking(slow_once())
    seconds = kd.measure(FakeWeight(64, 32), budget_end=BUCKETS - 0.5, time_fn=time_fn)
    assert asked == [*kd.ROW_BUCKETS, 1] and seconds[kd.BLOCKED][0] == 0.33
    # a sweep the budget cuts short returns what it timed (the rest None), with no second look
    clock[0] = 0.0
    time_fn, asked = ticking(slow_once())
    seconds = kd.measure(FakeWeight(64, 32), budget_end=2.5, time_fn=time_fn)
    assert asked == [1, 2, 4] and seconds[kd.ONEDNN][:4] == [0.60, 1.0, 1.0, None]


@pytest.mark.parametrize("changed", ["cpu_model", "cpu_flags", "torch", "threads", "kernels",
                                     "onednn"])
def test_a_new_cpu_torch_thread_count_or_kernel_build_measures_again(tmp_path, changed):
    measure, _ = timings(fast_from=6)
    kd.tune([FakeWeight(64, 32)], kd.DispatchCache(tmp_path, IDENTITY), measure_fn=measure)
    other = {**IDENTITY, changed: IDENTITY[changed] + "-new"}
    again, calls = timings(fast_from=0)
    fresh = [FakeWeight(64, 32)]
    kd.tune(fresh, kd.DispatchCache(tmp_path, other), measure_fn=again)
    assert calls == ["bf16:64x32:blocked+onednn"] and fresh[0].table == (kd.ONEDNN,) * BUCKETS
    # a file of another machine under this one's name is not believed either
    cache = kd.DispatchCache(tmp_path, IDENTITY)
    cache.path.write_text(json.dumps({"machine": other, "entries": {}}))
    assert kd.DispatchCache(tmp_path, IDENTITY).get("bf16:64x32:blocked+onednn") is None


def test_onednn_settings_are_part_of_the_machine_identity(monkeypatch):
    """A cap on oneDNN's instructions (a CPU without AMX emulated, say) or its fp32 math mode
    changes what ``F.linear`` runs, so timings taken without it are not reused under it."""
    for name in kd.ONEDNN_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = kd.machine_identity({"avx512f"})
    assert plain["onednn"] == ""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    capped = kd.machine_identity({"avx512f"})
    assert capped["onednn"] == "ONEDNN_MAX_CPU_ISA=AVX512_CORE"
    assert {k: v for k, v in capped.items() if k != "onednn"} == {
        k: v for k, v in plain.items() if k != "onednn"}


def test_past_the_budget_shapes_keep_the_static_table_and_are_not_cached(tmp_path):
    measure, calls = timings(fast_from=0)
    weights = [FakeWeight(64, 32), FakeWeight(16, 32)]
    kd.tune(weights, kd.DispatchCache(tmp_path, IDENTITY), budget_s=-1.0, measure_fn=measure)
    assert calls == [] and all(w.table == (kd.BLOCKED,) * BUCKETS for w in weights)
    assert not kd.DispatchCache(tmp_path, IDENTITY).path.exists()


def test_the_server_flag_takes_on_or_off_only(tmp_path):
    assert ServerArgs(model_path="m").cpu_kernel_autotune == "on"
    assert ServerArgs(model_path="m", cpu_kernel_autotune="off").cpu_kernel_autotune == "off"
    with pytest.raises(ValueError, match="cpu_kernel_autotune"):
        ServerArgs(model_path="m", cpu_kernel_autotune="auto")


ROWS = (1, 2, 3, 8, 16, 31, 32, 33, 64, 100, 200, 600)  # every bucket, and past the last


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_float_candidate_equals_the_native_reference_in_every_bucket(dtype):
    require_linear_kernel()
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=gen) / 8).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    packed = CpuPackedWeight(weight)
    expected = {kd.BLOCKED, kd.ONEDNN} | ({kd.AMX} if HAS_AMX and dtype == torch.bfloat16
                                          else set())
    assert set(packed.candidates) == expected
    kernels = packed.kernels()
    for rows in ROWS:
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        reference = x.double() @ weight.double().T + bias.double()
        for name in packed.candidates:
            out = kernels[name](x, bias)
            assert out.dtype == dtype and out.shape == (rows, 96), name
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
            else:
                bf16_close(out, reference)


def test_every_int8_candidate_equals_the_native_reference_in_every_bucket():
    require_ops("linear_int8")
    gen = torch.Generator().manual_seed(0)
    q, scales = quantize_int8(torch.randn(96, 64, generator=gen))
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    packed, native = CpuInt8Weight(q, scales), Int8Weight(q, scales)
    assert packed.candidates == (kd.INT8_VNNI, kd.INT8_DEQUANT)
    kernels = packed.kernels()
    for rows in ROWS:
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        reference = native.linear(x, bias)
        for name in packed.candidates:
            bf16_close(kernels[name](x, bias), reference.float())


def test_measure_times_each_candidate_in_every_bucket_and_stops_at_the_budget():
    require_linear_kernel()
    packed = CpuPackedWeight((torch.randn(64, 64) / 8).to(torch.bfloat16))
    seconds = kd.measure(packed)
    assert set(seconds) == set(packed.candidates)
    assert all(s is not None and s > 0 for row in seconds.values() for s in row), seconds
    assert all(s is None for row in kd.measure(packed, budget_end=0.0).values() for s in row)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_runs_its_tables_kernel_for_each_bucket(dtype):
    require_linear_kernel()
    packed = CpuPackedWeight((torch.randn(96, 64) / 8).to(dtype))
    names = [n for n in packed.candidates if n != kd.AMX]
    table = tuple(names[b % len(names)] for b in range(BUCKETS))
    packed.set_table(table)
    assert packed.batch_invariant == (set(table) == {kd.BLOCKED})
    kernels = packed.kernels()
    for rows in ROWS:
        x = torch.randn(rows, 64).to(dtype)
        chosen = table[kd.bucket_index(rows)]
        assert torch.equal(packed.linear(x, None), kernels[chosen](x, None)), (rows, chosen)


def test_prepack_model_restricts_deterministic_models_and_tunes_when_asked(tmp_path, monkeypatch):
    require_kernels()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with build_context("cpu", torch.bfloat16):
        model = torch.nn.Sequential(MergedColumnParallelLinear(64, [64, 64]),
                                    RowParallelLinear(128, 64))
    for p in model.parameters():
        p.data.normal_()
    prepack_model(model, 1 << 40, batch_invariant=True, cpu_kernel_autotune="on")
    for layer in model:
        assert layer.packed.candidates == (kd.BLOCKED,) and layer.packed.batch_invariant
        assert layer.packed.table == (kd.BLOCKED,) * BUCKETS
    assert not (tmp_path / "radixserve" / "autotune").exists()  # nothing to choose: no timing

    # the two shapes are measured (injected: oneDNN wins from 64 rows) and cached
    monkeypatch.setattr(kd, "measure", lambda weight, end: {
        name: [0.5 if name == kd.ONEDNN and b >= 6 else 1.0 for b in range(BUCKETS)]
        for name in weight.candidates})
    prepack_model(model, 1 << 40, cpu_kernel_autotune="on")
    files = list((tmp_path / "radixserve" / "autotune").glob("*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["entries"]
    assert set(entries) == {kd.shape_key(layer.packed) for layer in model}
    for layer in model:
        static = layer.packed.static()
        assert layer.packed.table == static[:6] + (kd.ONEDNN,) * 4
        x = torch.randn(5, layer.weight.shape[1]).to(torch.bfloat16)
        bf16_close(layer(x), F.linear(x.double(), layer.weight.double(), None))


class FakeWindow:
    def __init__(self, busy: bool) -> None:
        self.busy = busy

    def __enter__(self) -> FakeWindow:
        return self

    def __exit__(self, *exc) -> None:
        pass


class FakeLoad:
    """A ``LoadProbe`` whose machine is busy while measuring or not, quiet at start or not."""

    def __init__(self, busy_while_measuring: bool, quiet_at_start: bool) -> None:
        self.busy, self.quiet_now = busy_while_measuring, quiet_at_start
        self.looks = 0
        self.waits: list[float] = []

    def window(self) -> FakeWindow:
        return FakeWindow(self.busy)

    def quiet(self) -> bool:
        self.looks += 1
        return self.quiet_now

    def wait_until_quiet(self, max_s: float) -> bool:
        self.waits.append(max_s)
        return self.quiet_now


def test_a_table_timed_under_load_is_used_and_timed_again_once_the_machine_is_quiet(tmp_path):
    key = "bf16:64x32:blocked+onednn"
    measure, calls = timings(fast_from=6)
    load = FakeLoad(busy_while_measuring=True, quiet_at_start=False)
    weights = [FakeWeight(64, 32)]
    kd.tune(weights, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=measure, load=load)
    busy_table = (kd.BLOCKED,) * 6 + (kd.ONEDNN,) * 4
    assert calls == [key] and weights[0].table == busy_table  # used meanwhile
    assert load.waits == [kd.SETTLE_S]  # it waited (bounded) for a quiet machine first
    assert kd.DispatchCache(tmp_path, IDENTITY).busy_keys() == {key}
    # a later start on a machine still busy: the busy table, not timed again
    again, calls_again = timings(fast_from=0)
    still_busy = FakeLoad(busy_while_measuring=True, quiet_at_start=False)
    weights = [FakeWeight(64, 32)]
    kd.tune(weights, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again, load=still_busy)
    assert calls_again == [] and weights[0].table == busy_table and still_busy.looks == 1
    # a start on a quiet machine times it again, and the quiet table replaces the busy one
    quiet = FakeLoad(busy_while_measuring=False, quiet_at_start=True)
    kd.tune(weights, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again, load=quiet)
    assert calls_again == [key] and weights[0].table == (kd.ONEDNN,) * BUCKETS
    assert kd.DispatchCache(tmp_path, IDENTITY).busy_keys() == frozenset()
    # from then on no look at the machine and no wait: nothing is stale
    settled = FakeLoad(busy_while_measuring=False, quiet_at_start=True)
    kd.tune(weights, kd.DispatchCache(tmp_path, IDENTITY), measure_fn=again, load=settled)
    assert calls_again == [key] and settled.looks == 0 and settled.waits == []
