"""Timing helpers of ``hardware measure``: medians of batched calls, line fits, rounding."""

from __future__ import annotations

import math
import statistics
import time

MIN_BATCH_S = 5e-3             # a timed batch of short calls lasts at least this long
WARMUP_S = 0.05                # calls before timing: caches, allocator, thread pool and clock speed settle
SIGNIFICANT_DIGITS = 4         # the profile's numbers: more would only record noise


def _median(values) -> float:
    return float(statistics.median(values))


def deviation(samples) -> float:
    """The largest distance of a sample from the samples' median, as a share of the median: 0.1 means every
    repeat fell within 10% of the median (0 for a single sample)."""
    middle = _median(samples)
    if middle <= 0:
        return 0.0
    return max(abs(sample - middle) for sample in samples) / middle


def _synchronizer(device):
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_samples(fn, repeats: int, sync=lambda: None) -> list[float]:
    """Seconds of one ``fn()`` in each of ``repeats`` batches: calls for WARMUP_S first (the first calls of a
    kernel pay for its caches, allocations and threads starting), then batches of as many calls as make one
    last MIN_BATCH_S (one call of a few microseconds is below what the clock can resolve)."""
    warm_until = time.perf_counter() + WARMUP_S
    while True:
        fn()
        sync()
        if time.perf_counter() >= warm_until:
            break
    calls, elapsed = 1, 0.0
    while True:  # calibrate the batch size
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - started
        if elapsed >= MIN_BATCH_S or calls >= 1 << 12:
            break
        calls *= 4 if elapsed < MIN_BATCH_S / 8 else 2
    samples = [elapsed / calls]
    for _ in range(repeats - 1):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - started) / calls)
    return samples


def time_per_call(fn, repeats: int, sync=lambda: None) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` batches (``time_samples``)."""
    return _median(time_samples(fn, repeats, sync))


def fit_line(xs, ys) -> tuple[float, float]:
    """Ordinary least squares ``y = intercept + slope * x``."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return mean_y - slope * mean_x, slope


def fit_linear_cost(tokens, seconds) -> tuple[float, float]:
    """``fixed_s + per_token_s * n`` with both at least 0 (the profile refuses negative costs): the least-squares
    line, or the best line with the offending coefficient held at 0 when noise makes one negative."""
    fixed, per_token = fit_line(tokens, seconds)
    if per_token < 0:
        return max(sum(seconds) / len(seconds), 0.0), 0.0
    if fixed < 0:  # through the origin
        return 0.0, sum(n * t for n, t in zip(tokens, seconds)) / sum(n * n for n in tokens)
    return fixed, per_token


def _round(value: float) -> float:
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else value
