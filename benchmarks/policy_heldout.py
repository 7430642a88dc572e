"""Every online policy on every real trace at hand, against Belady's OPT and libCacheSim's policies, with
leave-one-trace-out for whatever is trained or tuned.

    python benchmarks/policy_heldout.py [--policies lru,coact,...] [--shared ../shared/traces]
                                        [--half-lives 2,4,8,16,32] [--shipped-learned] [--lookahead [0,1,2]]
                                        [--markdown FILE]

The traces: the bundled OLMoE-1B-7B trace, and from ``--shared`` (the repository's ../shared/traces by
default; left out, with a note, where absent) Qwen1.5-MoE-A2.7B (its six requests as one trace), Granite-3.0
1B-A400M served by SGLang (8 requests) and gpt-oss-120b (one chat request). The bundled tiny-Mixtral
recordings are left out: their router is not a trained model's. Each trace is flattened once (the replay's
order, trace/flatten.py); the cells are each trace at 12.5%, 25% and 50% of its experts. Every number is
misses / OPT's misses on the same flattened sequence (OPT: ``belady``, which agrees with libCacheSim's
Belady, tests/test_libcachesim_agreement.py).

The policies: every online policy of the registry (``moe-offload policies``) except the offline ones and
those that place or bypass (their misses are computed on the host, not paged: a different model from OPT's);
the seeded ones at seed 0. And twenty of libCacheSim's (ARC, LIRS, S3-FIFO, Cacheus, GDSF, WTinyLFU, LeCaR
and others), fed the same sequence as its oracleGeneral binary with capacity counted in experts.

Leave-one-trace-out, for the two policies with something fitted:

* ``coact`` (held out): for each trace, the half-life is the one of ``--half-lives`` whose median misses /
  OPT over the cells of the *other* traces is lowest; the table shows that run, and the chosen half-lives.
  The row ``coact`` is the shipped default (8 tokens) on every trace.
* ``learned`` (held out): where PyTorch is installed, the network is retrained for each trace on the other
  traces (moe_offload.training.train_learned_eviction, seed 0, one thread, at most 120 s per fold); with
  ``--shipped-learned`` or without PyTorch the shipped model is used, which was trained on OLMoE rows 0:150,
  so its OLMoE cells are not held out (a note says so).

``--lookahead H,...`` adds, for each H, an oracle row that no online policy can match, to measure what a
perfect prediction of the routing could gain: ``coact`` (default half-life) told the whole routing of the
token being served and of the H tokens after it (every layer, every rank), which keeps the experts those
tokens need (evicting, if it must, the one needed last) and ranks the others by their decayed count alone.
H = 0 bounds what the co-activation term P can gain; H = 1, what P and the transition term Q together can
(``--lookahead`` alone: H = 0).

It prints the table (rows: policies; columns: cells), each row's median and worst, and the best libCacheSim
policy per cell, then whether coact (held out) meets issue 35's bar: median <= 1.3 and no cell above the best
libCacheSim policy's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, AccessContext, make_policy
from moe_offload.policies.coact import CoActivation
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.flatten import write_oracle_general
from moe_offload.trace.format import read_trace
from moe_offload.trace.importers import import_routes_json, import_topk_jsonl

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
FRACTIONS = (0.125, 0.25, 0.5)
LIBCACHESIM = ("ARC", "LIRS", "S3FIFO", "Cacheus", "GDSF", "WTinyLFU", "LeCaR", "TwoQ", "SLRU", "Sieve", "LFUDA",
               "ClockPro", "LHD", "Hyperbolic", "MQ", "Clock", "LRU", "FIFO", "LFU", "Random")
QWEN_FILES = ("cooking_1", "history_1", "history_2", "ml_moe_1", "ml_moe_2", "ml_moe_3")
TARGET_MEDIAN = 1.3
LEARNED_FOLD_SECONDS = 120.0


def load_traces(shared: Path, say) -> dict[str, ReplayInput]:
    traces = {"olmoe": ReplayInput.of(read_trace(DEFAULT_TRACE), name="olmoe")}
    sources = {
        "qwen1.5": lambda: import_routes_json([shared / "qwen1.5-moe-a2.7b" / f"{name}.json" for name in QWEN_FILES],
                                              num_experts=60),
        # 8 requests of an 8-token prompt and 19 decode steps, as its recording's notes say (docs/traces.md)
        "granite": lambda: import_topk_jsonl(shared / "granite-3.0-1b-a400m" / "sglang_8_requests.jsonl",
                                             num_experts=32, request_rows=27, prompt_rows=8),
        "gpt-oss": lambda: import_topk_jsonl(shared / "gpt-oss-120b" / "chat_149_tokens.jsonl", num_experts=128),
    }
    for name, load in sources.items():
        try:
            traces[name] = ReplayInput.of(load(), name=name)
        except OSError as exc:
            say(f"[yellow]{name}: not available ({exc}); left out[/]")
    return traces


def cache_sizes(data: ReplayInput) -> list[int]:
    spec = data.spec
    return [max(spec.top_k, round(fraction * spec.num_layers * spec.num_experts)) for fraction in FRACTIONS]


def online_policies() -> list[str]:
    return [name for name, info in POLICIES.items()
            if not info.offline and not info.policy.places_or_bypasses]


def libcachesim_ratios(traces, opt, work: Path) -> dict[str, dict]:
    import libcachesim as lcs

    ratios: dict[str, dict] = {f"libCacheSim {name}": {} for name in LIBCACHESIM}
    for trace_name, data in traces.items():
        path = write_oracle_general(data.sequence, work / f"{trace_name}.oracleGeneral.bin", expert_bytes=None)
        for size in cache_sizes(data):
            for name in LIBCACHESIM:
                reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
                miss_ratio, _ = getattr(lcs, name)(size).process_trace(reader)
                ratios[f"libCacheSim {name}"][(trace_name, size)] = (round(miss_ratio * len(data.sequence))
                                                                     / opt[(trace_name, size)])
    return ratios


def ratios_of(traces, opt, policy: str, options=None, only=None) -> dict:
    return {(name, size): replay(data, policy, size, options=options).misses / opt[(name, size)]
            for name, data in traces.items() if only is None or name == only for size in cache_sizes(data)}


def coact_held_out(traces, opt, half_lives: list[float]) -> tuple[dict, dict]:
    """coact with, for each trace, the half-life that is best (lowest median) on the other traces."""
    by_half_life = {h: ratios_of(traces, opt, "coact", {"half_life": h}) for h in half_lives}
    chosen, ratios = {}, {}
    for held in traces:
        def others_median(h):
            return statistics.median(r for (name, _), r in by_half_life[h].items() if name != held)
        chosen[held] = min(half_lives, key=lambda h: (others_median(h), h))
        ratios.update({cell: r for cell, r in by_half_life[chosen[held]].items() if cell[0] == held})
    return ratios, chosen


def learned_held_out(traces, opt, say) -> dict:
    """The learned policy retrained for each trace on the other traces (leave-one-trace-out)."""
    from moe_offload.training import TrainingSource, train_learned_eviction

    ratios = {}
    for held in traces:
        sources = [TrainingSource(data.trace, (0, data.trace.num_tokens), cache_sizes(data))
                   for name, data in traces.items() if name != held]
        start = time.perf_counter()
        model = train_learned_eviction(sources, seed=0, threads=1, time_limit=LEARNED_FOLD_SECONDS).model
        say(f"learned, trained without {held}: {time.perf_counter() - start:.0f} s")
        ratios.update(ratios_of(traces, opt, "learned", {"model": model}, only=held))
    return ratios


class TokenLookahead(CoActivation):
    """coact's decayed counts, with the routing of the current token and of the ``horizon`` tokens after it
    known (the ``--lookahead`` oracle): an expert is needed if its next request (``ctx.next_use``, read at its
    last request) falls in one of them."""

    offline = True

    def __init__(self, spec, tokens, horizon):
        super().__init__(spec)
        self._tokens = tokens
        self._horizon = horizon
        self._next_use: dict[int, int] = {}

    @staticmethod
    def row(horizon: int) -> str:
        known = "this token" if horizon == 0 else f"this token and {horizon} more"
        return f"coact, routing of {known} known (oracle)"

    def on_access(self, key, ctx):
        super().on_access(key, ctx)
        self._next_use[key] = ctx.next_use

    def victim(self, ctx):
        residents = [key for key in self._heap[0][:self._size] if key not in ctx.pinned]
        needed = {key for key in residents if self._next_use[key] < len(self._tokens)
                  and self._tokens[self._next_use[key]] <= ctx.token + self._horizon}
        others = [key for key in residents if key not in needed]
        if others:
            return min(others, key=lambda key: (self._scaled[key], self._last_request[key]))
        return max(needed, key=self._next_use.__getitem__)


def lookahead_ratios(traces, opt, horizon: int) -> dict:
    ratios = {}
    for name, data in traces.items():
        seq = data.sequence
        keys, tokens, next_use = seq.expert_id.tolist(), seq.token.tolist(), seq.next_use.tolist()
        for size in cache_sizes(data):
            cache, ctx = ExpertCache(size, TokenLookahead(data.spec, tokens, horizon)), AccessContext()
            hits = 0
            for t, key in enumerate(keys):
                ctx.clock, ctx.token, ctx.next_use = t, tokens[t], next_use[t]
                hits += cache.request(key, ctx)
            ratios[(name, size)] = (len(keys) - hits) / opt[(name, size)]
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=None, help="comma-separated (default: every online policy)")
    parser.add_argument("--shared", type=Path, default=SHARED_TRACES, help="folder of the shared real traces")
    parser.add_argument("--half-lives", default="2,4,8,16,32", help="coact's candidates for leave-one-out")
    parser.add_argument("--shipped-learned", action="store_true", help="do not retrain learned per fold")
    parser.add_argument("--lookahead", nargs="?", const="0", default=None, metavar="H,...",
                        help="add the oracle rows told the routing of this token and H more (module doc; default 0)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    args = parser.parse_args()
    policies = args.policies.split(",") if args.policies else online_policies()
    for policy in policies:
        make_policy(policy, ReplayInput.of(read_trace(DEFAULT_TRACE)).spec)  # unknown names fail before any work
    try:
        half_lives = [float(h) for h in args.half_lives.split(",")]
        for h in half_lives:
            make_policy("coact", ReplayInput.of(read_trace(DEFAULT_TRACE)).spec, options={"half_life": h})
    except (ValueError, ConfigError) as exc:
        parser.error(f"--half-lives {args.half_lives!r}: {exc}")
    try:
        horizons = [int(h) for h in args.lookahead.split(",")] if args.lookahead is not None else []
        if any(h < 0 for h in horizons):
            raise ValueError("a horizon is a count of tokens, at least 0")
    except ValueError as exc:
        parser.error(f"--lookahead {args.lookahead!r}: {exc}")

    console = Console(width=250)
    say = console.print
    began = time.perf_counter()
    traces = load_traces(args.shared, say)
    cells = [(name, size) for name, data in traces.items() for size in cache_sizes(data)]
    opt = {(name, size): replay(data, "belady", size).misses for name, data in traces.items()
           for size in cache_sizes(data)}
    rows: dict[str, dict] = {}
    notes = []
    for policy in policies:
        if policy == "learned" and not args.shipped_learned:
            try:
                rows["learned (held out)"] = learned_held_out(traces, opt, say)
                continue
            except ImportError:  # the models extra (PyTorch) is not installed
                notes.append("learned: PyTorch is not installed, so the shipped model is used (trained on OLMoE "
                             "rows 0:150: its OLMoE cells are not held out)")
        elif policy == "learned":
            notes.append("learned: the shipped model, trained on OLMoE rows 0:150: its OLMoE cells are not held out")
        rows[policy] = ratios_of(traces, opt, policy)
    if "coact" in policies:
        rows["coact (held out)"], chosen = coact_held_out(traces, opt, half_lives)
        notes.append("coact (held out): half-life chosen on the other traces: "
                     + ", ".join(f"{name} {h:g}" for name, h in chosen.items()))
    for horizon in horizons:
        rows[TokenLookahead.row(horizon)] = lookahead_ratios(traces, opt, horizon)
    with tempfile.TemporaryDirectory(prefix="policy-heldout-") as work:
        try:
            libcachesim = libcachesim_ratios(traces, opt, Path(work))
        except ImportError:
            libcachesim = {}
            notes.append("libcachesim is not installed (pip install libcachesim): no libCacheSim rows")
    best_libcachesim = {cell: min(row[cell] for row in libcachesim.values()) for cell in cells} if libcachesim else {}

    fractions = {(name, size): fraction for name, data in traces.items()
                 for fraction, size in zip(FRACTIONS, cache_sizes(data))}
    headers = [f"{cell[0]} {fractions[cell] * 100:g}%" for cell in cells]
    table = Table(title="misses / OPT on each trace's flattened sequence (cache: % of the trace's experts)",
                  title_justify="left")
    for column in ["policy", *headers, "median", "worst", "cells <= best libCacheSim"]:
        table.add_column(column, justify="left" if column == "policy" else "right")
    lines = ["| policy | " + " | ".join(headers) + " | median | worst |", "|---" * (len(headers) + 3) + "|"]

    def add(name, ratios, style=None):
        values = [ratios[cell] for cell in cells]
        wins = (f"{sum(ratios[c] <= best_libcachesim[c] + 1e-12 for c in cells)}/{len(cells)}"
                if best_libcachesim else "-")
        row = [name, *(f"{v:.3f}" for v in values), f"{statistics.median(values):.3f}", f"{max(values):.3f}", wins]
        table.add_row(*row, style=style)
        lines.append("| " + " | ".join(row[:-1]) + " |")

    ordered = sorted(rows.items(), key=lambda item: statistics.median(item[1].values()))
    for name, ratios in ordered:
        add(name, ratios, "bold" if name.startswith("coact") else None)
    if libcachesim:
        add("best libCacheSim (per cell)", best_libcachesim, "bold")
        for name, ratios in sorted(libcachesim.items(), key=lambda item: statistics.median(item[1].values())):
            add(name, ratios)
    console.print(table)
    for note in notes:
        say(note)
    say("OPT misses: " + ", ".join(f"{h} {opt[c]:,}" for h, c in zip(headers, cells)))
    if "coact (held out)" in rows:
        held = rows["coact (held out)"]
        median = statistics.median(held.values())
        say(f"coact (held out): median {median:.3f} (bar {TARGET_MEDIAN}): " + ("met" if median <= TARGET_MEDIAN
                                                                            else "NOT met"))
        if best_libcachesim:
            above = [h for h, c in zip(headers, cells) if held[c] > best_libcachesim[c] + 1e-12]
            say("coact (held out) at most the best libCacheSim policy's in every cell: "
                + ("yes" if not above else f"NO, above in {', '.join(above)}"))
    say(f"{time.perf_counter() - began:.0f} s")
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
