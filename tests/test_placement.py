"""The placement policies against their rules: static-freq in hindsight serves exactly the C most requested
experts (counted here by hand, row by row), static-layers the last whole layers, pinned-lru and lfu-decay
on hand-built sequences."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, AccessContext, ModelSpec, make_policy
from moe_offload.simulator.cache import HIT, LOADED, ExpertCache
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.importers import import_routes_json

PLACEMENTS = ("static-freq", "static-layers", "pinned-lru", "lfu-decay")


def top_c_by_hand(trace, capacity: int) -> int:
    """The requests of the C most requested experts: every (token, layer, rank) is one request."""
    counts = Counter()
    J = trace.meta.num_experts
    for row in trace.experts.tolist():
        for layer, chosen in enumerate(row):
            for expert in chosen:
                counts[layer * J + expert] += 1
    return sum(sorted(counts.values(), reverse=True)[:capacity])


@pytest.mark.parametrize("capacity", [8, 32, 100])
def test_static_freq_in_hindsight_serves_the_top_c_of_the_bundled_trace(tiny_trace, capacity):
    result = replay(ReplayInput.of(tiny_trace, "tiny"), "static-freq", capacity)
    assert result.hits == top_c_by_hand(tiny_trace, capacity)
    assert result.misses == 0 and result.bypassed == result.accesses - result.hits


def test_static_freq_in_hindsight_serves_the_top_c_of_a_shared_trace(qwen_folder):
    trace = import_routes_json(qwen_folder / "history_2.json")
    capacity = trace.meta.num_expert_slots // 4
    result = replay(ReplayInput.of(trace), "static-freq", capacity)
    assert result.hits == top_c_by_hand(trace, capacity)
    # a fixed set can do no better than Belady, which may change its set
    assert result.fast_misses >= replay(ReplayInput.of(trace), "belady", capacity).misses


def test_static_freq_per_layer_and_with_a_profile(tiny_trace, tmp_path):
    spec = ModelSpec(tiny_trace.meta.num_layers, tiny_trace.meta.num_experts, tiny_trace.meta.top_k)
    J, L = spec.num_experts, spec.num_layers
    policy = make_policy("static-freq", spec, options={"per_layer": True})
    chosen = policy.placement(L + 1, tiny_trace)  # one per layer, two in layer 0
    assert [sum(1 for key in chosen if key // J == layer) for layer in range(L)] == [2] + [1] * (L - 1)
    with pytest.raises(ConfigError, match="static-freq.profile"):
        make_policy("static-freq", spec, options={"profile": str(tmp_path / "absent.parquet")})


def test_static_layers_keeps_the_last_whole_layers(tiny_trace):
    meta = tiny_trace.meta
    J, L = meta.num_experts, meta.num_layers
    result = replay(ReplayInput.of(tiny_trace), "static-layers", 2 * J + J - 1)  # two whole layers fit
    assert result.per_layer_hits[:L - 2] == [0] * (L - 2)
    assert result.per_layer_hits[L - 2:] == result.per_layer_accesses[L - 2:]
    spec = ModelSpec(L, J, meta.top_k)
    one = make_policy("static-layers", spec, options={"fast_layers": 1})
    assert one.placement(3 * J, tiny_trace) == list(range((L - 1) * J, L * J))
    with pytest.raises(ConfigError, match="fast_layers 3"):
        make_policy("static-layers", spec, options={"fast_layers": 3}).placement(2 * J, tiny_trace)


class Routed:
    """A trace-like profile: ``experts`` [tokens, L, K] is all ``expert_counts`` reads."""

    def __init__(self, rows):
        self.experts = np.asarray(rows, dtype=np.int64)


def test_pinned_lru_never_evicts_its_pinned_half():
    spec = ModelSpec(num_layers=1, num_experts=8, top_k=1)
    profile = Routed([[[0]], [[0]], [[0]], [[1]], [[1]], [[2]]])  # hottest: 0, then 1
    cache = ExpertCache(4, make_policy("pinned-lru", spec))
    ctx = AccessContext()
    cache.preload(profile, ctx)
    assert set(cache.resident) == {0, 1}  # pinned: floor(0.5 * 4) = 2 hottest
    outcomes = []
    for clock, key in enumerate([5, 6, 7, 5, 0, 6, 1]):
        ctx.clock = clock
        outcomes.append(cache.serve(key, ctx))
    # 5, 6 fill the LRU half; 7 evicts 5 (the oldest unpinned); 5 evicts 6; 0 hits; 6 evicts 7; 1 hits
    assert outcomes == [LOADED, LOADED, LOADED, LOADED, HIT, LOADED, HIT]
    assert set(cache.resident) == {0, 1, 5, 6}


def test_lfu_decay_forgets_old_frequency():
    spec = ModelSpec(num_layers=1, num_experts=8, top_k=1)
    policy = make_policy("lfu-decay", spec, options={"half_life": 2})
    cache = ExpertCache(2, policy)
    ctx = AccessContext()
    # 0 requested three times at clocks 0-2, 1 once at clock 7: s_0(7) = 2^-2.5 + 2^-3 + 2^-3.5 = 0.389 < s_1 = 1
    for clock, key in enumerate([0, 0, 0, 3, 3, 3, 3, 1]):
        ctx.clock = clock
        cache.serve(key, ctx)
    assert policy.score(0, 7) == pytest.approx(2 ** -2.5 + 2 ** -3 + 2 ** -3.5)
    ctx.clock = 8
    # resident {3, 1}: s_3(8) = 2^-2.5 + 2^-2 + 2^-1.5 + 2^-1 = 1.28 > s_1(8) = 2^-0.5 = 0.71: 1 goes
    assert cache.serve(2, ctx) == LOADED and set(cache.resident) == {3, 2}
    # plain LFU (huge half-life) would have kept 3 too, but LRU would have evicted 3
    ctx.clock = 9
    assert cache.serve(0, ctx) == LOADED and 2 not in cache.resident  # s_2 = 2^-0.5 < s_3


@pytest.mark.parametrize("policy", PLACEMENTS)
def test_every_placement_is_listed_and_replays_next_to_belady(tiny_trace, policy):
    assert policy in POLICIES
    data = ReplayInput.of(tiny_trace)
    result = replay(data, policy, 24)
    assert result.hits + result.misses + (result.bypassed or 0) == result.accesses
    assert result.fast_misses >= replay(data, "belady", 24).misses


def test_a_sweep_file_keeps_the_placement_columns_under_its_seal(tmp_path):
    # bypassed requests and the hindsight flag round-trip; a file whose placement columns were cut after it was
    # sealed is refused, not read with defaults
    import pyarrow.parquet as pq

    from moe_offload.results import RunResult
    from moe_offload.sweep.spec import Cell
    from moe_offload.sweep.store import Row, read_results, to_table

    result = RunResult(trace="t", policy="static-freq", cache_size=4, accesses=10, hits=6, misses=0, bypassed=4,
                       in_hindsight=True)
    table = to_table([Row(Cell("replay", "t", "static-freq", 4, None, None, 0, "{}"), result)])
    path = tmp_path / "results.parquet"
    pq.write_table(table, path)
    assert read_results(path)[0].result == result
    pq.write_table(table.drop_columns(["bypassed", "in_hindsight"]), path)
    with pytest.raises(ConfigError, match="do not match their checksum"):
        read_results(path)


@pytest.mark.parametrize("options", [{}, {"pinned_share": 0.25}, {"profile": "first-half"}])
def test_pinned_lrus_kernel_starts_from_its_hot_set_as_the_object(tiny_trace, tmp_path, options):
    # LRU's kernel given the hot set (run_kernel_arguments): the same hits as the object through the cache,
    # which loads the set before the first request, at sizes from one unpinned slot to most of the experts
    pytest.importorskip("numba")
    if options.get("profile"):
        from moe_offload.trace.format import write_trace

        write_trace(tiny_trace.select(slice(0, tiny_trace.num_tokens // 2)), tmp_path / "profile.parquet")
        options = {"profile": str(tmp_path / "profile.parquet")}
    data = ReplayInput.of(tiny_trace)
    for size in (4, 8, 21, 48):
        compiled = replay(data, "pinned-lru", size, options=options, engine="compiled")
        objects = replay(data, "pinned-lru", size, options=options, engine="python")
        assert compiled.per_layer_hits == objects.per_layer_hits, size
        assert compiled.bypassed == objects.bypassed == 0 and compiled.hits > 0


def test_the_simulate_table_shows_placements_next_to_belady(capsys):
    from moe_offload.cli.main import main

    assert main(["simulate", "--policy", "belady,lru,static-freq,static-layers", "--cache-size", "256",
                 "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "bypassed" in out and "static-layers" in out and "belady" in out
    assert "static-freq: placed in hindsight" in " ".join(out.split())
    assert "best online policy  k=256: lru" in out  # the hindsight placement is not ranked online


def test_timed_cli_runs_fetch_or_compute_and_refuses_a_profile_without_a_host(capsys, tmp_path):
    from moe_offload.cli.main import main

    assert main(["simulate", "--timed", "--policy", "lru,static-freq", "--prefetch", "none", "--cache-size", "25%",
                 "--fetch-or-compute", "--jobs", "1", "--timed-json", str(tmp_path / "out.json")]) == 0
    import json

    rows = {(row["policy"], row["prefetcher"]): row for row in json.loads((tmp_path / "out.json").read_text())}
    assert rows[("lru", None)]["admission"] == "fetch-or-compute"
    assert rows[("static-freq", None)]["bypassed"] > 0 and ("static-freq", "oracle") not in rows
    profile = tmp_path / "no-host.toml"
    profile.write_text('name = "no-host"\n[[tiers]]\nname = "gpu"\ncapacity_bytes = "24 GiB"\n[[tiers]]\n'
                       'name = "host"\ncapacity_bytes = "48 GiB"\n[[links]]\nfrom = "host"\nto = "gpu"\n'
                       'bandwidth_bytes_per_s = 25e9\n[compute]\nflops_per_s = 1e14\n'
                       'memory_bandwidth_bytes_per_s = 1e12\nattention = { fixed_s = 1e-5 }\n'
                       'router = { fixed_s = 1e-5 }\nlm_head = { fixed_s = 1e-4 }\n')
    capsys.readouterr()
    assert main(["simulate", "--timed", "--hardware", str(profile), "--policy", "static-freq", "--prefetch", "none",
                 "--cache-size", "25%"]) == 2
    assert "has no [host] compute" in capsys.readouterr().err
