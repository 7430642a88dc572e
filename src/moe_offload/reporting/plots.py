"""Plots of replay results in the style of paper 001, Figures 4 and 5."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from moe_offload.reporting.results import RunResult

_OFFLINE_STYLE = {"belady": dict(color="black", linestyle="--", linewidth=2),
                  "belady-dist": dict(color="dimgray", linestyle=":", linewidth=2)}


def plot_misses(results: list[RunResult], path, title: str | None = None) -> Path:
    """Misses against cache size for every policy (left) and the same relative to OPT (right), one row of
    panels per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    fig, axes = plt.subplots(len(by_trace), 2, figsize=(13, 4.8 * len(by_trace)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    policies = list(dict.fromkeys(r.policy for r in results))
    online = [p for p in policies if p not in _OFFLINE_STYLE]
    # ten colours, then the same colours dashed: every online policy stays distinguishable
    styles = {p: dict(color=cmap(i % 10), linestyle="-" if i < 10 else "--", linewidth=1.4, marker=".",
                      markersize=4) for i, p in enumerate(online)}
    for row, (trace, rows) in enumerate(by_trace.items()):
        left, right = axes[row]
        for policy in policies:
            points = sorted((r.cache_size, r.misses, r.misses_vs_opt) for r in rows if r.policy == policy)
            if not points:
                continue
            sizes, misses, ratio = zip(*points)
            style = _OFFLINE_STYLE.get(policy) or styles[policy]
            left.plot(sizes, misses, label=policy, **style)
            right.plot(sizes, [r if r is not None else float("nan") for r in ratio], label=policy, **style)
        left.set_xlabel("cache size k (experts)")
        left.set_ylabel("faults (misses)")
        left.set_title(f"{Path(trace).name}: misses vs cache size")
        right.set_xlabel("cache size k (experts)")
        right.set_ylabel("misses / OPT misses")
        right.set_title("normalised by Belady OPT")
        for ax in (left, right):
            ax.grid(alpha=0.3)
        right.legend(fontsize=8, ncol=2, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
