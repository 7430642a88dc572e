"""`hardware measure`'s stability: the spread of repeats, the busy machine, the peak FLOP rate, checked with
injected timings (a fake clock) and hand-computed numbers."""

from __future__ import annotations

import pytest

from moe_offload.runtime.measure import stability, timing


class FakeClock:
    """perf_counter that moves only when a call "runs": each call of ``fn`` takes the next scripted duration."""

    def __init__(self, durations):
        self.now, self.durations = 0.0, iter(durations)

    def perf_counter(self) -> float:
        return self.now

    def fn(self) -> None:
        self.now += next(self.durations)


def test_deviation_is_the_largest_distance_from_the_median():
    assert timing.deviation([1.0, 1.1, 0.9, 1.0, 1.3]) == pytest.approx(0.3)  # median 1.0, farthest 1.3
    assert timing.deviation([2.0]) == 0.0
    assert timing.deviation([4.0, 2.0, 3.0]) == pytest.approx(1 / 3)


def test_time_samples_warms_up_then_times_batches(monkeypatch):
    """Warm-up: 9 calls of 6 ms pass WARMUP_S = 50 ms (8 do not); a 10 ms call is one batch (>= MIN_BATCH_S); the
    repeats then take 10, 12 and 8 ms: samples are the calibration batch and the repeats, per call."""
    clock = FakeClock([6e-3] * 9 + [10e-3, 10e-3, 12e-3, 8e-3])
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    samples = timing.time_samples(clock.fn, repeats=4)
    assert samples == pytest.approx([10e-3, 10e-3, 12e-3, 8e-3])
    assert timing.deviation(samples) == pytest.approx(0.2)  # median 10 ms, 12 and 8 ms are 20% away


def test_short_calls_are_timed_in_batches(monkeypatch):
    """Calls of 1 ms: the batch grows 1 -> 2 -> 4 -> 8 calls until it lasts 5 ms, each sample is per call."""
    clock = FakeClock([1e-3] * 1000)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    assert timing.time_samples(clock.fn, repeats=3) == pytest.approx([1e-3] * 3)


def test_the_cpu_peak():
    # 2 CPUs at 2.6 GHz with AVX-512: 2 FMA x 16 float32 lanes x 2 FLOP = 64 FLOP a cycle
    assert stability.cpu_peak_flops(2, 2.6e9, {"avx512f", "avx2", "fma"}) == pytest.approx(332.8e9)
    assert stability.cpu_peak_flops(8, 3e9, {"avx2", "fma"}) == pytest.approx(8 * 3e9 * 32)
    assert stability.cpu_peak_flops(1, 1e9, set()) == pytest.approx(8e9)


def test_this_machines_peak_is_far_below_the_impossible_figure():
    import types

    peak, how = stability.peak_flops(types.SimpleNamespace(type="cpu"))
    assert 1e9 < peak < 442e15 and "FLOP/cycle" in how  # the figure once reported on a 2-core CPU


def notes(**overrides):
    given = dict(repeats=5, expert_deviation=0.1, link_deviation=0.1, load=0.5, cores=2, fitted_flops=1e9,
                 peak=1e11, peak_how="test")
    return stability.stability_notes(**{**given, **overrides})


def test_a_stable_measurement_on_an_idle_machine_has_no_note():
    assert notes() == []


@pytest.mark.parametrize("overrides, fragment", [
    (dict(expert_deviation=0.26), "one-token expert compute: the repeats lie up to 26% from their median"),
    (dict(link_deviation=0.6), "expert through the data path: the repeats lie up to 60%"),
    (dict(load=1.0), "the machine was busy (load average 1.0 on 2 cores)"),
    (dict(repeats=1), "1 repeat(s): too few"),
    (dict(fitted_flops=442e15), "fit 4.42e+08 GFLOP/s, above this machine's peak of 100 GFLOP/s (test)"),
    (dict(fitted_flops=float("inf")), "do not grow with the tokens, above this machine's peak"),
])
def test_each_doubt_is_one_note(overrides, fragment):
    found = notes(**overrides)
    assert len(found) == 1 and fragment in found[0], found
