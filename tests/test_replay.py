"""The replay simulator and the `simulate` command: counts, options, output formats, errors."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.cli.main import main
from moe_offload.errors import ConfigError
from moe_offload.simulator.grid import replay_grid
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.flatten import flatten, sample_sequence
from moe_offload.trace.format import write_trace
from moe_offload.trace.synthetic import zipf_trace


@pytest.fixture(scope="module")
def small_trace():
    return zipf_trace(num_layers=4, num_experts=8, top_k=2, length=300, a=1.0, b=1.0, seed=3, shuffle=True)


@pytest.fixture
def trace_file(small_trace, tmp_path):
    return str(write_trace(small_trace, tmp_path / "small.parquet"))


def test_flatten_order_is_token_then_rank_then_layer(small_trace):
    seq = flatten(small_trace)
    L, J, K = 4, 8, 2
    expected = [layer * J + int(small_trace.experts[n, layer, rank])
                for n in range(small_trace.num_tokens) for rank in range(K) for layer in range(L)]
    assert seq.expert_id.tolist() == expected
    assert (seq.layer == np.arange(len(seq)) % L).all()


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("rate", [0.3, 0.5, 1.0])
def test_a_sample_is_the_flattened_requests_of_the_sampled_experts(small_trace, monkeypatch, compiled, rate):
    from moe_offload.trace import flatten as flatten_module

    if not compiled:
        monkeypatch.setattr(flatten_module, "numba_available", lambda: False)
    whole = flatten(small_trace)
    # an expert is in the sample when its Knuth hash falls below rate * 2^32, whatever the part of the trace
    kept = [(key * 0x9E3779B1) % 2**32 < rate * 2**32 for key in range(32)]
    picked = [t for t, key in enumerate(whole.expert_id.tolist()) if kept[key]]
    sample = sample_sequence(small_trace, rate)
    assert sample.expert_id.tolist() == whole.expert_id[picked].tolist()
    assert sample.token.tolist() == [t // 8 for t in picked]  # 4 layers x top-2 requests a row
    assert sample.expert_id.dtype == sample.token.dtype == np.int32 and sample.rate == rate


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_layer_columns_are_each_layers_requests_in_time_order(small_trace, monkeypatch, compiled, rate):
    from moe_offload.trace import flatten as flatten_module

    if not compiled:
        monkeypatch.setattr(flatten_module, "numba_available", lambda: False)
    seq = flatten(small_trace) if rate == 1.0 else sample_sequence(small_trace, rate)
    layer = seq.expert_id // 8
    assert 0 < len(seq) and (rate == 1.0 or set(np.bincount(layer, minlength=4)) != {len(seq) // 4})
    for first, stop in [(0, 4), (1, 3), (3, 4)]:
        for column in (seq.expert_id, seq.token):
            pieces = seq.layer_columns(column, first, stop)
            assert len(pieces) == stop - first
            for at, piece in enumerate(pieces, start=first):
                assert piece.dtype == np.int32 and piece.flags.c_contiguous
                assert piece.tolist() == column[layer == at].tolist()


def test_a_dist_replay_gathers_its_layers_in_groups_of_any_size(small_trace, monkeypatch):
    from moe_offload.simulator import replay as replay_module

    whole = replay(ReplayInput.of(small_trace), "lcp-dist", 12, engine="python").to_dict()
    for flattened in (False, True):  # off the trace; from the flattened sequence
        data = ReplayInput.of(small_trace)
        if flattened:
            data.sequence
        for gather_bytes in (1, 4 * 600 * 3):  # one layer a pass; three, the last group one layer
            monkeypatch.setattr(replay_module, "GATHER_BYTES", gather_bytes)
            assert replay(data, "lcp-dist", 12, engine="compiled").to_dict() == whole


def test_a_dist_replay_reads_its_layers_off_the_trace_without_the_whole_sequence(small_trace):
    data = ReplayInput.of(small_trace)
    result = replay(data, "lcp-dist", 12, engine="compiled")
    assert data._sequence is None  # nothing flattened: a day of traffic's sequence would be gigabytes
    assert result.to_dict() == replay(ReplayInput.of(small_trace), "lcp-dist", 12, engine="python").to_dict()
    seq = flatten(small_trace)
    for first, stop in ((0, 4), (1, 3)):
        keys, rows = data.layer_requests(first, stop, tokens=True)  # off the trace: data is not flattened
        assert [k.tolist() for k in keys] == [k.tolist() for k in seq.layer_columns(seq.expert_id, first, stop)]
        assert [r.tolist() for r in rows] == [r.tolist() for r in seq.layer_columns(seq.token, first, stop)]
        assert all(k.dtype == r.dtype == np.int32 for k, r in zip(keys, rows))
        assert all(r.size == 0 for r in data.layer_requests(first, stop, tokens=False)[1])
    assert data._sequence is None


def test_counts_add_up_and_per_layer_rates(small_trace):
    result = replay(ReplayInput.of(small_trace), "lru", 12)
    assert result.accesses == 300 * 4 * 2 == result.hits + result.misses
    assert sum(result.per_layer_accesses) == result.accesses
    assert sum(result.per_layer_hits) == result.hits
    assert result.per_layer_accesses == [600] * 4


def test_every_miss_is_counted_once_when_everything_fits(small_trace):
    distinct = len(np.unique(flatten(small_trace).expert_id))
    for policy in ("lru", "lfu", "llru", "lcp", "moe-infinity", "fmoe", "learned", "marking", "random"):
        assert replay(ReplayInput.of(small_trace), policy, 32).misses == distinct


def test_grid_reports_against_opt_and_is_independent_of_jobs(small_trace):
    data = ReplayInput.of(small_trace)
    serial = replay_grid(data, ["lru", "llru", "lru-dist"], [2, 8, 16], jobs=1)
    parallel = replay_grid(data, ["lru", "llru", "lru-dist"], [2, 8, 16], jobs=2)
    assert [r.to_dict() for r in serial.results] == [r.to_dict() for r in parallel.results]
    assert all(r.opt_misses <= r.misses for r in serial.results)
    # lru-dist needs one slot per layer: it cannot run with 2 experts for 4 layers, and says so.
    assert [(policy, size) for policy, size, _ in serial.skipped] == [("lru-dist", 2)]
    assert {(r.policy, r.cache_size) for r in serial.results} == {
        (p, k) for p in ("lru", "llru", "lru-dist") for k in (2, 8, 16)} - {("lru-dist", 2)}


def test_a_grid_replays_once_the_policies_that_make_the_same_decisions(small_trace, monkeypatch):
    """fMoE on a trace without router probabilities ranks as LFU: the grid replays LFU once for both, and
    fMoE's row is what its own replay makes; given probabilities, fMoE replays on its own."""
    import moe_offload.simulator.grid as grid_module
    replayed = []
    task = grid_module._replay_task
    monkeypatch.setattr(grid_module, "_replay_task", lambda data, t: replayed.append(t[:2]) or task(data, t))
    data = ReplayInput.of(small_trace)
    grid = replay_grid(data, ["lfu", "fmoe", "lru"], [4, 8], jobs=2)
    assert sorted(replayed) == sorted([("belady", 4), ("belady", 8), ("lfu", 4), ("lfu", 8), ("lru", 4), ("lru", 8)])
    by_run = {(r.policy, r.cache_size): r for r in grid.results}
    for size in (4, 8):
        alone = replay(ReplayInput.of(small_trace), "fmoe", size)
        alone.opt_misses = by_run[("lru", size)].opt_misses
        assert by_run[("fmoe", size)].to_dict() == alone.to_dict()

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(8), size=(small_trace.num_tokens, 4)).astype(np.float16)
    with_probs = ReplayInput.of(dataclasses.replace(small_trace, probs=probs))
    replayed.clear()
    replay_grid(with_probs, ["lfu", "fmoe"], [4], jobs=1)
    assert sorted(replayed) == [("belady", 4), ("fmoe", 4), ("lfu", 4)]


def test_cache_smaller_than_top_k_is_refused(small_trace):
    with pytest.raises(ConfigError, match="smaller than top-k"):
        replay(ReplayInput.of(small_trace), "lru", 1)


def test_simulate_json(trace_file, capsys):
    assert main(["simulate", trace_file, "--policy", "lru,belady", "--cache-size", "8,50%", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["policy"], r["cache_size"]) for r in rows} == {("lru", 8), ("lru", 16), ("belady", 8), ("belady", 16)}
    for row in rows:
        assert {"policy", "cache_size", "accesses", "hits", "misses", "hit_rate", "misses_vs_opt"} <= set(row)
        assert row["hits"] + row["misses"] == row["accesses"]
        assert row["hit_rate"] == pytest.approx(row["hits"] / row["accesses"])


def test_simulate_table_and_plot(trace_file, tmp_path, capsys):
    plot = tmp_path / "misses.png"
    assert main(["simulate", trace_file, "--policy", "lru,llru,lcp", "--cache-size", "0.25",
                 "--plot", str(plot), "--plot-points", "4"]) == 0
    out = capsys.readouterr().out
    assert "cache of 8 experts" in out and "misses / OPT" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,message", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--cache-size", "1"], "smaller than top-k"),
    (["--cache-size", "abc"], "neither a number of experts"),
    (["--cache-size", "1.5"], "a fraction must be in (0, 1]"),
    (["--policy-option", "lcp.rho"], "POLICY.NAME=VALUE"),
    (["--policy", "lru", "--policy-option", "lru.whole_layers=[0]"], "policy 'lru' has no option whole_layers"),
    (["--policy", "lru-dist", "--cache-size", "10", "--policy-option", "lru-dist.whole_layers=[0]"],
     "a cache of 10 experts cannot hold 1 whole layers of 8 experts and one expert in each of the other 3"),
    (["--policy", "lru-dist", "--policy-option", "lru-dist.whole_layers=[99]"], "lru-dist.whole_layers"),
])
def test_simulate_bad_options_fail_in_one_line(trace_file, capsys, args, message):
    assert main(["simulate", trace_file, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_simulate_missing_trace(tmp_path, capsys):
    missing = tmp_path / "missing.parquet"
    assert main(["simulate", str(missing)]) == 2
    assert f"{missing}: no such file" in capsys.readouterr().err


def test_policy_options_reach_the_policy(trace_file, capsys):
    main(["simulate", trace_file, "--policy", "lcp", "--cache-size", "8", "--json"])
    default = json.loads(capsys.readouterr().out)[0]["misses"]
    main(["simulate", trace_file, "--policy", "lcp", "--cache-size", "8", "--json", "--policy-option", "lcp.rho=0.01",
          "--policy-option", "lcp.omega=1"])
    assert json.loads(capsys.readouterr().out)[0]["misses"] != default


def test_default_trace_is_bundled_and_replays(capsys):
    assert DEFAULT_TRACE.exists()
    assert main(["simulate", "--policy", "lru,llru", "--cache-size", "25%", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["cache_size"] for r in rows} == {256}
    assert rows[0]["accesses"] == 299 * 16 * 8
    assert {r["trace"] for r in rows} == {"olmoe"}  # the bundled name, as the README's table shows it


def test_results_name_each_trace_as_the_command_line_does(trace_file, capsys):
    # a bundled name stays the name, not the package's file path; a file stays the path given
    assert main(["simulate", "tiny", trace_file, "--policy", "lru", "--cache-size", "4", "--json"]) == 0
    assert {r["trace"] for r in json.loads(capsys.readouterr().out)} == {"tiny", trace_file}
    assert main(["simulate", "tiny", "--timed", "--policy", "lru", "--prefetch", "none", "--cache-size", "25%",
                 "--json"]) == 0
    assert {r["trace"] for r in json.loads(capsys.readouterr().out)} == {"tiny"}


def test_policies_command_lists_every_policy(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in ("lru", "belady-dist", "moe-infinity", "fmoe", "lcp", "learned", "marking"):
        assert name in out


def test_every_source_cites_what_a_user_can_read():
    # a source names a paper or a project, never a tracker entry of this repository's development
    from moe_offload.policies import POLICIES
    from moe_offload.prefetch import PREFETCHERS

    sources = {name: f"{info.policy.source} {info.partitioned_source}" for name, info in POLICIES.items()}
    sources.update((name, prefetcher.source) for name, prefetcher in PREFETCHERS.items())
    for name, source in sources.items():
        assert not re.search(r"\bissue \d+", source), f"{name}: {source}"


def test_a_grid_run_during_another_replays_its_own_input():
    # the report runs the first rows' Python replays on a thread while the whole trace's run: a grid started
    # while another runs (here from the first's progress callback, between its Python runs) must not hand
    # its input to the other's runs
    first = ReplayInput.of(zipf_trace(2, 8, 2, 60, a=1.0, b=1.0, seed=1, shuffle=True), name="first")
    second = ReplayInput.of(zipf_trace(2, 8, 2, 90, a=1.0, b=1.0, seed=2, shuffle=True), name="second")
    alone = [result.to_dict() for result in replay_grid(first, ["learned"], [4, 6], engine="python").results]
    nested = []

    def start_another(_accesses):
        if not nested:
            nested.append(replay_grid(second, ["learned"], [4], engine="python"))

    during = replay_grid(first, ["learned"], [4, 6], progress=start_another, engine="python")
    assert [result.to_dict() for result in during.results] == alone
    assert nested[0].results[0].accesses == 90 * 2 * 2


@pytest.mark.parametrize("engine", ["compiled", "python"])
def test_a_dist_cache_holding_layers_whole_against_lru_by_hand(engine):
    # the bundled OLMoE trace (16 x 64): layers 3 and 9 held whole hit every request; each other layer is an
    # LRU of its share, (300 - 128) // 14 = 12 slots (13 for the first 4 of them), replayed here by hand
    from collections import OrderedDict

    from moe_offload.trace.format import read_trace

    data = ReplayInput.of(read_trace(DEFAULT_TRACE))
    result = replay(data, "lru-dist", 300, options={"whole_layers": [9, 3]}, engine=engine)
    seq = data.sequence
    others = [layer for layer in range(16) if layer not in (3, 9)]
    for layer in range(16):
        keys = seq.expert_id[seq.layer == layer].tolist()
        if layer in (3, 9):
            assert result.per_layer_hits[layer] == len(keys)
            continue
        capacity = 12 + (others.index(layer) < 4)
        lru, hits = OrderedDict(), 0
        for key in keys:
            if key in lru:
                hits += 1
                lru.move_to_end(key)
            else:
                if len(lru) == capacity:
                    lru.popitem(last=False)
                lru[key] = None
        assert result.per_layer_hits[layer] == hits
