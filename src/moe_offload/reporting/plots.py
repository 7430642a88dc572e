"""Plots of replay results in the style of paper 001, Figures 4 and 5, and of timed runs (latency CDF, timeline)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from moe_offload.outputs import atomic_output
from moe_offload.reporting.tables import binary_bytes, run_label
from moe_offload.results import RunResult

# The formats a plot may be written in, by its file's extension (commands check it before they run).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")

_OFFLINE_STYLE = {"belady": dict(color="black", linestyle="--", linewidth=2),
                  "belady-dist": dict(color="dimgray", linestyle=":", linewidth=2)}
# Seven markers against ten colours: 7 and 10 share no factor, so the first 70 curves each get a colour and
# marker pair of their own, and two curves of one colour (the 1st and the 11th) differ in marker and dash.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def curve_styles(names) -> dict[str, dict]:
    """A distinct colour and marker pair for each of ``names`` (see _MARKERS), dashed from the 11th on."""
    import matplotlib

    colours = matplotlib.colormaps["tab10"]
    return {name: dict(color=colours(i % 10), marker=_MARKERS[i % len(_MARKERS)],
                       linestyle="-" if i < 10 else "--") for i, name in enumerate(names)}


def coinciding_labels(curves: dict[str, tuple]) -> dict[str, str]:
    """Legend labels that say which curves are drawn over each other: ``curves`` maps a name to its points
    (equal tuples: the same line), and a name whose points another curve also has becomes "lfu (= fmoe)"."""
    same: dict[tuple, list[str]] = defaultdict(list)
    for name, points in curves.items():
        same[points].append(name)
    labels = {}
    for name, points in curves.items():
        others = [other for other in same[points] if other != name]
        labels[name] = f"{name} (= {', '.join(others)})" if others else name
    return labels


def plot_misses(results: list[RunResult], path, title: str | None = None) -> Path:
    """Requests not served from fast memory against cache size for every policy (left) and the same relative to
    OPT's misses (right), one row of panels per trace. A placement's bypassed requests (computed where the
    expert lives) count with its misses, so every policy is on one axis; a placement chosen from the replayed
    trace itself (in hindsight) is a bound, not a policy a user can run: dash-dotted and labelled so."""
    plt = _pyplot()
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    fig, axes = plt.subplots(len(by_trace), 2, figsize=(13, 4.8 * len(by_trace)), squeeze=False)
    policies = list(dict.fromkeys(r.policy for r in results))
    styles = curve_styles([p for p in policies if p not in _OFFLINE_STYLE])
    for row, (trace, rows) in enumerate(by_trace.items()):
        left, right = axes[row]
        curves = {policy: tuple(sorted((r.cache_size, r.fast_misses, r.misses_vs_opt) for r in rows
                                       if r.policy == policy)) for policy in policies}
        curves = {policy: points for policy, points in curves.items() if points}
        hindsight = {r.policy for r in rows if r.in_hindsight}
        labels = coinciding_labels(curves)
        for policy, points in curves.items():
            sizes, missed, ratio = zip(*points)
            style = _OFFLINE_STYLE.get(policy) or dict(styles[policy], linewidth=1.4, markersize=4)
            label = labels[policy]
            if policy in hindsight:
                style, label = dict(style, linestyle="-."), f"{label} (hindsight, a bound)"
            left.plot(sizes, missed, label=label, **style)
            right.plot(sizes, [r if r is not None else float("nan") for r in ratio], label=label, **style)
        left.set_xlabel("cache size k (experts)")
        left.set_ylabel("requests not served from fast memory\n(misses + bypassed)")
        left.set_title(f"{Path(trace).name}: requests not served from fast memory vs cache size")
        right.set_xlabel("cache size k (experts)")
        right.set_ylabel("(misses + bypassed) / OPT misses")
        right.set_title("normalised by Belady OPT")
        for ax in (left, right):
            ax.grid(alpha=0.3)
        right.legend(fontsize=8, ncol=2, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    """Write the figure atomically, in the format its extension names (one of PLOT_SUFFIXES)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with atomic_output(path) as temporary:
            fig.savefig(temporary, dpi=120, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
    return path


def plot_latency_cdf(results: list[RunResult], path) -> Path:
    """Timed runs, one row of panels per trace: the CDF of every output token's latency (the gap to the
    request's previous token, whose mean per request is TPOT) and the CDF of TTFT over requests."""
    import numpy as np
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    plt = _pyplot()
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    fig, axes = plt.subplots(len(by_trace), 2, figsize=(13, 4.6 * len(by_trace)), squeeze=False)
    for row, (trace, rows) in enumerate(by_trace.items()):
        tokens, first = axes[row]
        names = [cdf_label(r) for r in rows]
        styles = curve_styles([name for name, r in zip(names, rows) if r.policy != "all-resident"])
        labels = coinciding_labels({name: (tuple(r.token_latency_seconds or ()), tuple(r.request_ttft_seconds or ()))
                                    for name, r in zip(names, rows)})
        for name, r in zip(names, rows):
            style = dict(color="black", linestyle="--") if r.policy == "all-resident" else dict(
                styles[name], linestyle=":" if r.prefetcher == "oracle" else styles[name]["linestyle"])
            for ax, values in ((tokens, r.token_latency_seconds), (first, r.request_ttft_seconds)):
                if values:
                    ms = np.sort(np.asarray(values)) * 1e3
                    ax.step(np.concatenate([[ms[0]], ms]), np.arange(ms.size + 1) / ms.size, where="post",
                            label=labels[name], linewidth=1.5, markevery=max(1, ms.size // 8), markersize=4,
                            **style)
        tokens.set_xlabel("token latency (ms)")
        tokens.set_title(f"{Path(trace).name}: output tokens after the first")
        first.set_xlabel("time to first token (ms)")
        first.set_title(f"TTFT over {len(rows[0].request_ttft_seconds or [])} request(s)")
        for ax in (tokens, first):
            ax.set_ylabel("fraction")
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3)
        tokens.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


_COMPUTE_COLOURS = {"attention": "tab:green", "router": "tab:olive", "expert": "tab:blue", "lm_head": "tab:purple",
                    "search": "tab:brown"}
_TRANSFER_COLOURS = {"demand": "tab:red", "prefetch": "tab:cyan", "search": "tab:brown", "decision": "tab:olive"}


def cdf_label(result: RunResult) -> str:
    """A timed run's name with its cache (several cache sizes share a plot): "lru, no prefetch, 32 experts
    (1.5 GiB)"; the all-resident bound has none."""
    if result.policy == "all-resident" or result.cache_bytes is None:
        return run_label(result)
    return f"{run_label(result)}, {result.cache_size} experts ({binary_bytes(result.cache_bytes)})"


def plot_timeline(results: list[RunResult], path) -> Path:
    """One panel per timed run: the iteration its ``timeline`` holds, lane by lane (compute by kind, stalls,
    each link's demand loads and prefetches, the host's experts, the prefetcher's matcher), with the start of
    every layer."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    shown = [r for r in results if r.timeline]
    fig, axes = plt.subplots(len(shown), 1, figsize=(15, 0.6 + 1.9 * len(shown)), squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        timeline = r.timeline
        lanes = timeline["lanes"]
        y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
        for event in timeline["events"]:
            start, end = event["start_s"] * 1e3, event["end_s"] * 1e3
            if event["lane"] == "compute":
                colour = _COMPUTE_COLOURS[event["kind"]]
            elif event["lane"] == "stall":
                colour = "tab:orange"
            elif event["lane"] == "host":  # an expert the host computes (a bypassed miss)
                colour = "tab:purple"
            else:
                colour = _TRANSFER_COLOURS[event["kind"]]
            # transfers and stalls come in runs of equal bars: a thin white edge tells them apart
            edges = dict(edgecolors="white", linewidth=0.3) if event["lane"] != "compute" else dict(linewidth=0)
            ax.broken_barh([(start, max(end - start, 1e-4))], (y[event["lane"]] - 0.38, 0.76), facecolors=colour,
                           **edges)
        layer_starts = sorted({(e["layer"], e["start_s"]) for e in timeline["events"]
                               if e["lane"] == "compute" and e["kind"] == "attention"})
        for layer, start in layer_starts:
            ax.axvline(start * 1e3, color="grey", linewidth=0.4, alpha=0.6)
            ax.text(start * 1e3, len(lanes) - 0.45, str(layer), fontsize=6, color="grey")
        duration = timeline["duration_s"] * 1e3
        ax.set_xlim(0, duration)
        ax.set_yticks([y[lane] for lane in lanes], lanes)
        ax.set_title(f"{Path(r.trace).name}: {run_label(r)}, iteration {timeline['iteration']} "
                     f"({duration:.2f} ms; numbers mark the start of each layer)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since the iteration started (ms)")
    legend = [Patch(color=c, label=k) for k, c in _COMPUTE_COLOURS.items()]
    legend += [Patch(color="tab:orange", label="stall"), Patch(color="tab:red", label="demand load"),
               Patch(color="tab:cyan", label="prefetch")]
    if any("host" in r.timeline["lanes"] for r in shown):
        legend.append(Patch(color="tab:purple", label="host expert"))
    if any("policy" in r.timeline["lanes"] for r in shown):
        legend.append(Patch(color="tab:olive", label="eviction decision"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(fig, path)
