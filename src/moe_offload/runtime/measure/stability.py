"""How far ``hardware measure``'s numbers can be trusted: the spread of the repeats, how busy the machine was,
and the peak FLOP rate no measurement may exceed.

A timing repeated N times is reported as its median and its *deviation*: the largest distance of a repeat from
the median, as a share of it (timing.deviation). Above STABLE_DEVIATION the number is noise more than a
property of the machine, and the command says so rather than let the timed simulator take it as a fact.

Other work inflates every timing: the 1-minute load average (runnable processes, ours included) against the
cores says how much. A load of half the cores or more means the benchmark's threads shared them.

The peak bounds what the expert's roofline may claim. The roofline's FLOP rate is 2 P / slope, the slope of
one expert's time over its tokens (runtime/measure/__init__.py, expert_roofline); where the times are flat
within noise the slope tends to 0 and the rate to infinity (a 2-core CPU was once given 442 PFLOP/s). No
machine computes faster than

    peak = cores x clock x FLOP per cycle and core

so a fitted rate above it is not a measurement: the profile holds the peak instead, and a note says why. The
bound is deliberately generous (every logical CPU, the highest clock the system reports or 1.5 times the
current one, two fused multiply-adds per cycle of the widest vectors; on a GPU 8,192 FLOP per cycle and
multiprocessor, twice an H100's dense 16-bit tensor rate, at 2.5 GHz): it rejects the impossible without
touching anything a real machine achieves.
"""

from __future__ import annotations

import os
from pathlib import Path

STABLE_DEVIATION = 0.25        # repeats further than this from their median: the number is not stable
BUSY_LOAD_PER_CORE = 0.5       # a load average of half the cores or more: other work shared them
TURBO_MARGIN = 1.5             # the current clock times this, where the highest clock is not reported
DEFAULT_CLOCK_HZ = 6e9         # no clock reported at all: above any CPU's
GPU_FLOP_PER_CYCLE_PER_SM = 8192
GPU_CLOCK_HZ = 2.5e9


def cpu_flop_per_cycle(flags: set[str]) -> int:
    """float32 FLOP per cycle and core: two fused multiply-adds (2 FLOP per lane) on the widest vectors the
    CPU has (16 lanes with AVX-512, 8 with AVX2 and FMA), else two 4-lane operations a cycle."""
    if "avx512f" in flags:
        return 2 * 2 * 16
    if "fma" in flags or "avx2" in flags or "asimd" in flags:
        return 2 * 2 * 8
    return 2 * 4


def cpu_peak_flops(cores: int, clock_hz: float, flags: set[str]) -> float:
    return cores * clock_hz * cpu_flop_per_cycle(flags)


def _cpu_clock_and_flags() -> tuple[float, str, set[str]]:
    """(the highest clock in Hz, where it came from, the CPU's feature flags)."""
    flags, current_mhz = set(), 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags |= set(value.split())
            elif key.strip() == "cpu MHz":
                current_mhz = max(current_mhz, float(value))
    except (OSError, ValueError):
        pass
    try:
        highest_khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
        return highest_khz * 1e3, "the highest clock the system reports", flags
    except (OSError, ValueError):
        pass
    if current_mhz:
        return current_mhz * 1e6 * TURBO_MARGIN, f"{TURBO_MARGIN:g} x the current clock", flags
    return DEFAULT_CLOCK_HZ, f"{DEFAULT_CLOCK_HZ / 1e9:g} GHz (no clock reported)", flags


def peak_flops(device) -> tuple[float, str]:
    """(an upper bound of this machine's FLOP/s on ``device``, how it was found)."""
    if device.type == "cuda":
        import torch

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return (sms * GPU_CLOCK_HZ * GPU_FLOP_PER_CYCLE_PER_SM,
                f"{sms} multiprocessors x {GPU_FLOP_PER_CYCLE_PER_SM:,} FLOP/cycle x {GPU_CLOCK_HZ / 1e9:g} GHz")
    cores = os.cpu_count() or 1
    clock, origin, flags = _cpu_clock_and_flags()
    per_cycle = cpu_flop_per_cycle(flags)
    return (cpu_peak_flops(cores, clock, flags),
            f"{cores} CPUs x {clock / 1e9:.3g} GHz ({origin}) x {per_cycle} FLOP/cycle")


def load_average() -> float:
    return os.getloadavg()[0]


def stability_notes(*, repeats: int, expert_deviation: float, link_deviation: float, load: float, cores: int,
                    fitted_flops: float, peak: float, peak_how: str) -> list[str]:
    """What makes the measurement less than a fact, one sentence each (empty when nothing does):
    ``expert_deviation`` and ``link_deviation`` are the one-token expert compute's and the link's
    (timing.deviation), ``load`` the largest load average seen, ``fitted_flops`` the roofline's rate before
    it is held to ``peak``."""
    notes = []
    if repeats < 3:
        notes.append(f"{repeats} repeat(s): too few to know how stable the timings are (--repeats 5 or more)")
    for what, spread in (("one-token expert compute", expert_deviation), ("expert through the data path",
                                                                          link_deviation)):
        if spread > STABLE_DEVIATION:
            notes.append(f"{what}: the repeats lie up to {spread:.0%} from their median (more than "
                         f"{STABLE_DEVIATION:.0%}): the number is not stable; rerun on a quieter machine or with "
                         "more --repeats")
    if load >= BUSY_LOAD_PER_CORE * cores:
        notes.append(f"the machine was busy (load average {load:.1f} on {cores} cores): every timing includes "
                     "waiting for other work")
    if fitted_flops > peak:
        fitted = ("do not grow with the tokens" if fitted_flops == float("inf")
                  else f"fit {fitted_flops / 1e9:,.3g} GFLOP/s")
        notes.append(f"the expert's times over 1..64 tokens {fitted}, above this machine's peak of "
                     f"{peak / 1e9:,.3g} GFLOP/s ({peak_how}): flat within noise, so the profile holds the peak")
    return notes
