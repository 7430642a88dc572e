"""Plots: every curve has a colour and marker pair of its own, curves drawn over each other say so in the
legend, and a timed run's label carries its cache size."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from moe_offload.reporting import plots  # noqa: E402
from moe_offload.results import RunResult  # noqa: E402


def legend_texts(monkeypatch, draw, results, tmp_path) -> list[list[str]]:
    """The legend entries of every panel of the figure ``draw`` makes (captured instead of saved)."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    draw(results, tmp_path / "plot.png")
    return [[text.get_text() for text in ax.get_legend().get_texts()]
            for ax in figures[0].axes if ax.get_legend() is not None]


def test_sixteen_curves_have_sixteen_colour_and_marker_pairs():
    styles = plots.curve_styles([f"p{i}" for i in range(16)])
    pairs = {(style["color"], style["marker"]) for style in styles.values()}
    assert len(pairs) == 16
    # the 1st and the 11th share tab10's first colour: their markers (o, then _MARKERS[10 % 7] = D) differ
    assert styles["p0"]["color"] == styles["p10"]["color"] and (styles["p0"]["marker"], styles["p10"]["marker"]) == ("o", "D")


def test_seventy_curves_are_all_distinct():
    styles = plots.curve_styles(range(70))  # 7 markers x 10 colours, coprime: every pair once
    assert len({(s["color"], s["marker"]) for s in styles.values()}) == 70


def test_coinciding_curves_name_each_other():
    labels = plots.coinciding_labels({"lru": (1, 2), "lfu": (3, 4), "fmoe": (3, 4), "x": (3, 4), "lcp": (3, 5)})
    assert labels == {"lru": "lru", "lfu": "lfu (= fmoe, x)", "fmoe": "fmoe (= lfu, x)", "x": "x (= lfu, fmoe)",
                      "lcp": "lcp"}


def replay(policy, size, misses, opt):
    return RunResult(trace="t", policy=policy, cache_size=size, accesses=100, hits=100 - misses, misses=misses,
                     opt_misses=opt)


def test_the_misses_legend_says_which_curves_coincide(monkeypatch, tmp_path):
    results = [replay("belady", 4, 10, 10), replay("belady", 8, 5, 5),
               replay("lru", 4, 30, 10), replay("lru", 8, 20, 5),
               replay("lfu", 4, 25, 10), replay("lfu", 8, 12, 5),
               replay("fmoe", 4, 25, 10), replay("fmoe", 8, 12, 5)]
    (legend,) = legend_texts(monkeypatch, plots.plot_misses, results, tmp_path)
    assert legend == ["belady", "lru", "lfu (= fmoe)", "fmoe (= lfu)"]


def test_a_placements_bypassed_requests_are_on_the_misses_axis_and_a_hindsight_one_is_a_bound(monkeypatch,
                                                                                            tmp_path):
    # static-layers at 4 experts: 2 misses and 18 bypassed, 20 requests not served from fast memory, 2x OPT's
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    results = [replay("belady", 4, 10, 10), replay("lru", 4, 30, 10),
               RunResult(trace="t", policy="static-layers", cache_size=4, accesses=100, hits=80, misses=2,
                         bypassed=18, opt_misses=10),
               RunResult(trace="t", policy="static-freq", cache_size=4, accesses=100, hits=95, misses=0,
                         bypassed=5, opt_misses=10, in_hindsight=True)]
    plots.plot_misses(results, tmp_path / "plot.png")
    left, right = figures[0].axes
    drawn = {line.get_label(): (line.get_ydata()[0], line.get_linestyle()) for line in left.get_lines()}
    assert drawn["static-layers"] == (20, "-") and drawn["static-freq (hindsight, a bound)"] == (5, "-.")
    ratios = {line.get_label(): line.get_ydata()[0] for line in right.get_lines()}
    assert ratios["static-layers"] == 2.0 and ratios["static-freq (hindsight, a bound)"] == 0.5
    assert "not served from fast memory" in left.get_ylabel()


def timed(policy, prefetcher, experts, latencies):
    return RunResult(trace="t", policy=policy, cache_size=experts, accesses=1, hits=1, misses=0,
                     prefetcher=prefetcher, cache_bytes=experts * 2**20 if policy != "all-resident" else None,
                     token_latency_seconds=latencies, request_ttft_seconds=[0.01])


def test_cdf_labels_carry_the_cache_size(monkeypatch, tmp_path):
    results = [timed("all-resident", None, 64, [0.001, 0.002]), timed("lru", None, 16, [0.003, 0.004]),
               timed("lru", None, 32, [0.002, 0.003]), timed("lru", "topk", 1536, [0.002, 0.005])]
    (legend,) = legend_texts(monkeypatch, plots.plot_latency_cdf, results, tmp_path)
    assert legend == ["all-resident", "lru, no prefetch, 16 experts (16 MiB)", "lru, no prefetch, 32 experts (32 MiB)",
                      "lru + topk, 1536 experts (1.5 GiB)"]
    assert len(set(legend)) == len(legend)
