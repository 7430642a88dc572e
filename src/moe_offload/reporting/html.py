"""The report as one self-contained HTML page: its figures are inline SVG drawn by matplotlib, its style an
inline block; nothing is fetched when it opens (no script, no link, no image file)."""

from __future__ import annotations

import html
import io

import numpy as np

from moe_offload.version import __version__
from moe_offload.reporting.bound import TARGET_HIT_RATES
from moe_offload.reporting.on_engine import HEADER as ENGINE_HEADER, section_lines, setting_notes, setting_rows
from moe_offload.reporting.report import Report, latency_rows, plural, policy_rows, working_set_rows
from moe_offload.reporting.tables import run_label

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
.verdict { font-size: 1.15em; background: #f4f4ee; border-left: 4px solid #886; padding: 0.8em 1em; }
table { border-collapse: collapse; margin: 1em 0; } td, th { padding: 0.25em 0.8em; border-bottom: 1px solid #ddd; }
td { text-align: right; } td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; } .note { color: #555; font-size: 0.9em; }
figure { margin: 1em 0; } svg { max-width: 100%; height: auto; }
"""


def _svg(fig) -> str:
    """The figure as an inline <svg> element (matplotlib's SVG less its XML prologue and doctype). Its text
    stays text (``svg.fonttype`` none), drawn by the browser in the page's font, not as glyph outlines: the
    page is half the size, and its figures' labels can be searched and copied."""
    plt = load_pyplot()
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def load_pyplot():
    """matplotlib's pyplot on the Agg backend (no display). Importing it takes about 0.4 s, which the report
    spends on a thread of its own while its replays run rather than after them (cli/report_cmd.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(width: float = 7.5, height: float = 3.6):
    fig, ax = load_pyplot().subplots(figsize=(width, height))
    ax.grid(alpha=0.3)
    return fig, ax


def working_set_figure(report: Report) -> str:
    ws = report.working_set
    fig, ax = _figure()
    windows = np.array(ws.windows)
    ax.fill_between(windows, ws.distinct_mean.min(axis=1), ws.distinct_mean.max(axis=1), alpha=0.25,
                    label="layers' means, lowest to highest")
    ax.plot(windows, ws.distinct_mean.mean(axis=1), marker="o", label="mean over layers")
    ax.plot(windows, ws.distinct_max.max(axis=1), linestyle=":", marker=".", label="largest window")
    ax.axhline(report.per_layer_budget, color="black", linestyle="--", label="budget per layer")
    ax.set_xscale("log")
    ax.set_xlabel("window (tokens)")
    ax.set_ylabel("distinct experts of a layer")
    ax.legend(fontsize=8)
    return _svg(fig)


def reuse_figure(report: Report) -> str:
    ws = report.working_set
    fig, ax = _figure()
    sizes = np.arange(report.total_experts + 1)
    ax.plot(sizes, ws.lru.hit_rates(), label="LRU: requests of reuse distance below the size")
    opt = report.bound.opt
    ax.plot(sizes, opt.hit_rates(), linestyle="--", color="black",
            label="Belady (OPT)" + ("" if opt.exact else f", from {opt.rate:.1%} of the experts"))
    ax.axvline(report.cache_size, color="gray", linestyle=":", label="budget")
    ax.axhline(ws.max_hit_rate(), color="red", linestyle=":", linewidth=1, label="every cache's most (cold misses)")
    ax.set_xlabel("cache size (experts)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    return _svg(fig)


def skew_figure(report: Report) -> str:
    ws = report.working_set
    fig, ax = _figure(height=3.2)
    per_layer = max(1, int(report.per_layer_budget))
    shares = ws.hottest_share(per_layer)
    ax.bar(np.arange(len(shares)), shares, color="tab:purple")
    ax.axhline(per_layer / report.meta.num_experts, color="black", linestyle="--",
               label=f"uniform routing: {per_layer} of {report.meta.num_experts}")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"share of requests, hottest {per_layer}")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return _svg(fig)


def policies_figure(report: Report) -> str:
    bound = report.bound
    results = [bound.belady] + bound.online
    fig, ax = _figure(height=0.28 * len(results) + 1.2)
    names = ["belady (OPT)"] + [r.policy for r in bound.online]
    ax.barh(np.arange(len(results))[::-1], [r.hit_rate for r in results],
            color=["black"] + ["tab:blue"] * len(bound.online))
    ax.set_yticks(np.arange(len(results))[::-1], names)
    ax.set_xlabel(f"hit rate at {report.cache_size:,} experts")
    ax.set_xlim(0, 1)
    return _svg(fig)


def latency_figure(report: Report) -> str:
    latency = report.latency
    runs = [latency.all_resident] + latency.candidates()
    fig, ax = _figure(height=0.28 * len(runs) + 1.2)
    labels = [run_label(r) for r in runs]
    ax.barh(np.arange(len(runs))[::-1], [(r.tpot_seconds or 0) * 1e3 for r in runs], color="tab:green")
    ax.set_yticks(np.arange(len(runs))[::-1], labels)
    ax.set_xlabel(f"TPOT on {latency.hardware} (ms)")
    return _svg(fig)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: Report) -> str:
    meta, ws, bound, latency = report.meta, report.working_set, report.bound, report.latency
    e = html.escape
    per_layer = max(1, int(report.per_layer_budget))
    shares = ws.hottest_share(per_layer)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>moe-offload report: {e(report.trace)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
        f"<h1>{e(report.trace)}: policy or working set?</h1>",
        f"<p>{e(meta.model)}, {meta.num_layers} layers &times; {meta.num_experts} experts, top-{meta.top_k}; "
        f"{report.tokens:,} tokens in {plural(report.requests, 'request')}, {ws.requests:,} expert requests. "
        f"Fast memory: {e(report.budget_text())}.</p>",
        f'<p class="verdict">{e(report.verdict)}</p>',
        "<h2>Working set</h2>",
        "<p>Distinct experts a layer selects within a window of consecutive tokens, against the layer's share of "
        "the budget: a window whose experts exceed it cannot be served without misses by any policy.</p>",
        f"<figure>{working_set_figure(report)}</figure>",
        _table(("window (tokens)", "mean", "max", "mean / budget per layer"), working_set_rows(report)),
        f"<p>Reuse distance (distinct other experts since an expert's last request) below the budget: "
        f"{ws.lru_hit_rate(report.cache_size):.2%} of requests, LRU's hit rate; first requests, cold misses of "
        f"any cache: {ws.cold_requests / ws.requests:.2%}.</p>",
        f"<figure>{reuse_figure(report)}</figure>",
        f"<p>Skew: the {per_layer} hottest experts of a layer take {shares.mean():.1%} of its requests "
        f"(layers from {shares.min():.1%} to {shares.max():.1%}); pinning the {report.cache_size:,} hottest "
        f"experts, chosen in hindsight, would serve {ws.pinned_hit_rate(report.cache_size):.2%}.</p>",
        f"<figure>{skew_figure(report)}</figure>",
        "<h2>The bound</h2>",
        f"<figure>{policies_figure(report)}</figure>",
        _table(("policy", "hit rate", "of OPT's hits", "not served from fast memory", "replayed on"), policy_rows(report)),
        "<p>Belady (OPT) needs, for a hit rate of "
        + ", ".join(f"{target:.0%}: {e(report.size_text(bound.needed[target]))}" for target in TARGET_HIT_RATES)
        + f". No cache hits more than {bound.max_hit_rate:.2%} (first requests always miss). OPT at every size: "
        f"{e(bound.sampling_text())}.</p>",
    ]
    if bound.prefix_text() is not None:
        parts.append(f"<p>{e(bound.prefix_text())}.</p>")
    if latency is not None:
        parts += [f"<h2>Latency on {e(latency.hardware)}</h2>",
                  f"<p>Timed simulator on {e(latency.replayed)}, trace iterations as recorded.</p>",
                  f"<figure>{latency_figure(report)}</figure>",
                  _table(("run", "TTFT ms", "TPOT ms", "hit rate", "stall ms"), latency_rows(latency))]
        if latency.moepic_config is not None:
            config = latency.moepic_config
            rows = [(str(i), f"{layer['budget']:.2f}", str(layer["cache_size"]), f"{layer['split_ratio']:.3f}",
                     str(layer["prefetches"]), f"{layer['hit_rate']:.2%}") for i, layer in enumerate(config["layers"])]
            parts += [f"<p>MoEpic's split of {config['budget_experts']:,} experts (plus its prefetch buffer of "
                      f"{meta.top_k}):</p>",
                      _table(("layer", "budget (experts)", "cached", "split ratio", "prefetch", "LCP hit rate"), rows)]
    if report.on_engine is not None:
        on_engine = report.on_engine
        lines = section_lines(on_engine, report.trace, report.fast_memory)
        parts += ["<h2>On your engine</h2>",
                  f"<p>{e(on_engine.split)}; the runs replay {e(on_engine.replayed)} on {e(on_engine.hardware)}.</p>"]
        for section in on_engine.engines:
            parts += [f"<h3>{e(section.name)}</h3>", f'<p class="note">{e(section.source)}</p>',
                      _table(ENGINE_HEADER, setting_rows(section))]
            notes = setting_notes(section)
            if notes:
                parts.append('<ul class="note">' + "".join(f"<li>{e(label)}: {e(note)}</li>" for label, note in notes)
                             + "</ul>")
            parts.append("<pre>" + e("\n".join(lines[section.name])) + "</pre>")
    parts += ["<h2>What to run</h2>", "<pre>" + e("\n".join(report.commands)) + "</pre>"]
    notes = report.notes + (latency.notes if latency is not None else [])
    parts += [f'<p class="note">note: {e(note)}</p>' for note in notes]
    parts += [f'<p class="note">moe-offload {e(__version__)} report</p>', "</body>", "</html>"]
    return "\n".join(parts) + "\n"
