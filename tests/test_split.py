"""MoEpic's split experts in the timed simulator (simulator/split.py): a timeline worked out by hand, the
unsplit run as the case theta = 1, and `configure --json` fed to `simulate --timed --split-config`.

The hardware is test_timed's ``profile()``: one link host -> gpu (100 B/s unless a test says otherwise,
0.5 s latency per transfer), attention 1 s and router 0.25 s per layer, 2 s per expert, LM head 0.5 s;
experts of 100 B.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_offload.cli.main import main
from moe_offload.errors import ConfigError
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig
from moe_offload.simulator.timed import simulate_timed
from moe_offload.trace.format import Trace, write_trace
from moe_offload.trace.synthetic import zipf_trace
from test_configurator import routed_trace
from test_timed import E, NextLayerTruth, hand_trace, multi_request, profile, spec_of, transfers

HALVES = SplitConfig((LayerSplitPlan(cached_experts=1, split_ratio=0.5),))  # one layer: one top of 50 B


def test_one_layer_one_link_one_expert_split_in_halves_by_hand():
    # One layer, one expert needed by three tokens; its top half (50 B) is cached, the bottom half (50 B) is
    # fetched every time. The link carries 50 B/s: a whole expert takes 0.5 + 100/50 = 2.5 s, a bottom
    # segment 0.5 + 50/50 = 1.5 s. The top half computes in 0.5 x 2 = 1 s, the bottom half in 1 s.
    #   token 0: attention 0 -> 1, router -> 1.25; nothing cached: the whole expert 1.25 -> 3.75 (stall 2.5)
    #            into the empty buffer of K = 1 expert (100 B), its top cached as it lands; top half 3.75 -> 4.75,
    #            bottom half -> 5.75 (then it leaves the buffer), LM head -> 6.25                 TTFT 6.25
    #   token 1: attention -> 7.25, router -> 7.5; the top is cached: the bottom loads 7.5 -> 9.0 while the
    #            top half computes 7.5 -> 8.5; stall 8.5 -> 9.0 (0.5); bottom half 9.0 -> 10.0, LM head -> 10.5
    #   token 2: the same 4.25 s later: 14.75                                  TPOT (14.75 - 6.25) / 2 = 4.25
    # Stall 2.5 + 0.5 + 0.5 = 3.5 s; the link moved 100 + 50 + 50 = 200 B.
    trace = hand_trace([[[0]], [[0]], [[0]]], layers=1, num_experts=1)
    result = simulate_timed(trace, profile(bandwidth=50.0), "lru", split=HALVES, timeline_iteration=1)
    assert result.ttft_seconds == pytest.approx(6.25)
    assert result.tpot_seconds == pytest.approx(4.25)
    assert result.token_latency_seconds == pytest.approx([4.25, 4.25])
    assert result.per_layer_stall_seconds == pytest.approx([3.5])
    assert result.bytes_per_link == {"host->gpu": 200}
    assert (result.accesses, result.hits, result.on_demand_loads) == (3, 0, 3)  # never complete in VRAM
    # the memory reported is the top segment and the buffer of K = 1 expert: 50 + 100 B, 1.5 experts' worth
    assert result.cache_bytes == 150 and result.cache_size == 2
    assert transfers(result) == [("host->gpu", "demand", 0, 1.25, 2.75)]  # from iteration 1's start, 6.25
    experts = [t for e in result.timeline["events"] if e["kind"] == "expert" for t in (e["start_s"], e["end_s"])]
    assert experts == pytest.approx([1.25, 2.25, 2.75, 3.75])  # top half overlaps the bottom's load

    # Unsplit, the cached expert would not load again: 1 + 0.25 + 2 + 0.5 = 3.75 s per decode token.
    whole = simulate_timed(trace, profile(bandwidth=50.0), "lru", 1 * E)
    assert whole.tpot_seconds == pytest.approx(3.75)


def test_a_preloaded_split_streams_what_it_does_not_cache_by_hand():
    # vLLM's --cpu-offload-gb as split experts (engines/vllm.py): layer 0 caches no top (its experts offloaded
    # whole), layer 1 caches the tops of all four experts, a quarter of each, from the start. One expert a
    # layer per token, at 100 B/s with 0.5 s a transfer:
    #   token 0: attention 0 -> 1, router -> 1.25; layer 0's expert comes whole (0.5 + 1.0 s) -> 2.75 (stall 1.5),
    #            runs 2 s -> 4.75 and leaves the buffer; layer 1: attention -> 5.75, router -> 6.0; its top is
    #            there: its quarter runs 6.0 -> 6.5 while the other three quarters load (0.5 + 0.75 s) -> 7.25
    #            (stall 0.75), the rest runs 1.5 s -> 8.75; LM head -> 9.25                           TTFT 9.25
    #   token 1: the same, nothing kept: 18.5                                                         TPOT 9.25
    preloaded = SplitConfig((LayerSplitPlan(0, 1.0), LayerSplitPlan(4, 0.25)), preloaded=True)
    trace = hand_trace([[[1], [2]], [[1], [2]]], layers=2)
    result = simulate_timed(trace, profile(), "lru", split=preloaded)
    assert result.ttft_seconds == pytest.approx(9.25) and result.tpot_seconds == pytest.approx(9.25)
    assert result.per_layer_stall_seconds == pytest.approx([3.0, 1.5])
    assert result.bytes_per_link == {"host->gpu": 2 * (100 + 75)}
    assert (result.accesses, result.hits, result.on_demand_loads) == (4, 0, 4)
    # every top whole and preloaded is every expert in VRAM from the start: no transfer, 2 x 3.25 + 0.5 a token
    resident = simulate_timed(trace, profile(), "lru", split=SplitConfig((LayerSplitPlan(4, 1.0),) * 2,
                                                                         preloaded=True))
    assert resident.tpot_seconds == pytest.approx(7.0) and resident.bytes_per_link == {"host->gpu": 0}
    assert resident.hits == resident.accesses == 4


def test_a_preloaded_split_may_fill_the_gpu_its_buffer_being_reads_in_place():
    # two layers of four experts of 100 B: every top whole fills a GPU of 800 B; MoEpic's configuration would also
    # need its buffer of K = 1 expert there, a preloaded one (vLLM's UVA) reads in place
    trace = hand_trace([[[1], [2]], [[1], [2]]], layers=2)
    whole = (LayerSplitPlan(4, 1.0),) * 2
    result = simulate_timed(trace, profile(gpu=800), "lru", split=SplitConfig(whole, preloaded=True))
    assert result.cache_bytes == 800 and result.hits == 4
    with pytest.raises(ConfigError, match=r"the cached top segments \(800 B\) and the buffer of 1 experts \(100 B\) "
                                          r"need 900 B, more than the 800 B"):
        simulate_timed(trace, profile(gpu=800), "lru", split=SplitConfig(whole))


def test_the_runtime_refuses_what_only_the_simulator_splits():
    from moe_offload.runtime.split import load_split_config

    with pytest.raises(ConfigError, match="layer 0 caches no top segment: the runtime splits experts as MoEpic"):
        load_split_config(SplitConfig((LayerSplitPlan(0, 1.0), LayerSplitPlan(4, 0.25))))
    with pytest.raises(ConfigError, match="its tops are loaded before the first pass"):
        load_split_config(SplitConfig((LayerSplitPlan(4, 0.25),), preloaded=True))


def test_a_prefetched_bottom_segment_lands_in_the_buffer_by_hand():
    # As above at 100 B/s (whole expert 1.5 s, bottom segment 1.0 s), with a prefetcher proposing layer 0's
    # expert before each iteration.
    #   token 0: prefetch of the whole expert 0 -> 1.5 into the empty buffer (100 B: room for it), its top
    #            cached as it lands; router ends 1.25, stall 0.25 (a late prefetch);
    #            top half 1.5 -> 2.5, bottom half -> 3.5, LM head -> 4.0                          TTFT 4.0
    #   token 1: the prefetch of the bottom 4.0 -> 5.0 lands in the buffer before the router ends at 5.25;
    #            both halves 5.25 -> 7.25, LM head -> 7.75: no stall                              TPOT 3.75
    trace = hand_trace([[[0]], [[0]]], layers=1, num_experts=1)
    result = simulate_timed(trace, profile(), "lru", split=HALVES, prefetcher=NextLayerTruth(spec_of(trace)),
                            timeline_iteration=1)
    assert (result.ttft_seconds, result.tpot_seconds, result.stall_seconds) == pytest.approx((4.0, 3.75, 0.25))
    assert transfers(result) == [("host->gpu", "prefetch", 0, 0.0, 1.0)]
    assert result.bytes_per_link == {"host->gpu": 150}
    assert (result.prefetches_issued, result.prefetches_used, result.hits) == (2, 2, 1)


def partitioned_pair(prefetcher):
    """A split run with theta = 1 and C_i = J (three layers of 8 experts, top-2) and the unsplit run of lru-dist
    over a cache of all L x J experts, whose partition each layer's cache of tops then is."""
    trace = multi_request(zipf_trace(num_layers=3, num_experts=8, top_k=2, length=60, a=1.0, b=1.0, seed=5,
                                     shuffle=True), requests=3)
    whole = SplitConfig(tuple(LayerSplitPlan(8, 1.0) for _ in range(3)))
    return (simulate_timed(trace, profile(), "lru-dist", split=whole, prefetcher=prefetcher),
            simulate_timed(trace, profile(), "lru-dist", 3 * 8 * E, prefetcher=prefetcher))


TIMINGS = ("ttft_seconds", "tpot_seconds", "stall_seconds", "per_layer_stall_seconds", "request_ttft_seconds",
           "request_tpot_seconds", "token_latency_seconds", "total_seconds", "bytes_per_link", "on_demand_loads")


def test_theta_one_with_every_expert_cached_is_the_partitioned_run():
    # theta = 1 and C_i = J: the top segment is the whole expert and nothing is ever evicted. A miss loads the
    # whole expert through the buffer of K = 2 experts, its top cached as it lands; the buffer holds at most one
    # expert computing and one on the wire or landed. Each expert computes at least 2 s, longer than a load
    # (1.5 s), so the next load has room before the link would have carried it: the unsplit run's timeline,
    # the same hits. The memory reported counts the buffer of K = 2 experts all the same.
    split, partitioned = partitioned_pair(None)
    same = TIMINGS + ("hits", "misses")
    assert {name: getattr(split, name) for name in same} == {name: getattr(partitioned, name) for name in same}
    assert (split.cache_bytes, split.cache_size) == (partitioned.cache_bytes + 2 * E, 3 * 8 + 2)


def test_theta_one_with_prefetches_waits_for_the_buffer_the_partitioned_run_does_not_have():
    # With the oracle's prefetches the unsplit run reserves every prefetched expert its room in the cache at
    # once; the split run puts each into the buffer of K = 2 whole experts, where it waits for room (the
    # paper's U_b). The same experts are prefetched and used (the cache of tops never evicts), and the waits
    # hide behind the compute (2 s per expert against 1.5 s per load, as above): the same timeline. But a
    # prefetch that started later may still be on the wire when its layer is routed: used, not a hit (here 348
    # hits against 352).
    split, partitioned = partitioned_pair("oracle")
    assert {name: getattr(split, name) for name in TIMINGS} == {name: getattr(partitioned, name) for name in TIMINGS}
    assert (split.prefetches_issued, split.prefetches_used) == (partitioned.prefetches_issued,
                                                                partitioned.prefetches_used)
    assert split.hits <= partitioned.hits and split.hits + split.misses == partitioned.hits + partitioned.misses


def test_theta_one_with_smaller_caches_is_the_partitioned_run():
    # Top-1 decode, two cached experts per layer, no prefetching: a miss loads the whole expert into the buffer of
    # K = 1 expert, alone there (the previous layer's expert has run and left it) and in time as in the unsplit
    # run; its top is cached as it lands and the cache never has to refuse it (nothing pinned or buffered but the
    # expert itself), so the split run evicts as lru-dist does on a cache of 2 L experts.
    trace = multi_request(zipf_trace(num_layers=4, num_experts=8, top_k=1, length=80, a=0.8, b=1.0, seed=3,
                                     shuffle=True), requests=2)
    split = simulate_timed(trace, profile(), "lru-dist", split=SplitConfig((LayerSplitPlan(2, 1.0),) * 4))
    partitioned = simulate_timed(trace, profile(), "lru-dist", 4 * 2 * E)
    assert (split.hits, split.tpot_seconds, split.ttft_seconds, split.stall_seconds) == \
        (partitioned.hits, partitioned.tpot_seconds, partitioned.ttft_seconds, partitioned.stall_seconds)


@pytest.mark.parametrize("prefetcher", [None, "oracle"])
def test_free_transfers_make_any_split_cost_nothing(prefetcher):
    # With infinite bandwidth and no latency every missing segment arrives at once: the two shares of an
    # expert run back to back and each token takes as long as with every expert resident.
    trace = multi_request(zipf_trace(num_layers=3, num_experts=8, top_k=2, length=60, a=1.0, b=1.0, seed=7,
                                     shuffle=True), requests=3)
    free = profile(bandwidth=float("inf"), latency=0.0)
    bound = simulate_timed(trace, free, all_resident=True)
    split = simulate_timed(trace, free, "lru", split=SplitConfig((LayerSplitPlan(3, 0.4),) * 3),
                           prefetcher=prefetcher)
    assert split.stall_seconds == 0.0 and split.bytes_loaded > 0
    assert split.request_tpot_seconds == pytest.approx(bound.request_tpot_seconds)
    assert split.request_ttft_seconds == pytest.approx(bound.request_ttft_seconds)


@pytest.fixture
def routed_file(tmp_path):
    return str(write_trace(routed_trace(tokens=60), tmp_path / "routed.parquet"))


def test_configure_json_runs_in_the_simulator(routed_file, tmp_path, capsys):
    assert main(["configure", routed_file, "--vram-budget", "25%", "--hardware", "desktop-rtx4090", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    # the timings follow from the preset: a 4096-byte expert over PCIe 4.0, one token's compute times
    timings = document["timings_seconds"]
    assert 0 < timings["expert_load"] < 1e-3 and timings["moe"] == pytest.approx(2 * timings["expert_compute"])
    config_file = tmp_path / "split.json"
    config_file.write_text(json.dumps(document))
    out_json = tmp_path / "timed.json"
    assert main(["simulate", routed_file, "--timed", "--hardware", "desktop-rtx4090", "--policy", "lcp",
                 "--prefetch", "moepic", "--split-config", str(config_file), "--timed-json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    # the memory of a split run: the top segments and the buffer of K = 2 experts, to the nearest whole expert
    top_bytes = sum(layer["cache_size"] * round(layer["split_ratio"] * 4096) for layer in document["layers"])
    memory = top_bytes + 2 * 4096
    assert round(memory / 4096) == 24  # 25% of 96 experts: the tops and the buffer, which is inside the budget
    assert [(r["policy"], r["prefetcher"], r["cache_size"]) for r in rows] == [
        ("all-resident", None, 6 * 16), ("lcp", "moepic", 24), ("lcp", "oracle", 24)]
    assert all(r["cache_bytes"] == memory for r in rows[1:])
    assert all(any("split experts" in note for note in r["notes"]) for r in rows[1:])
    assert rows[1]["tpot_seconds"] >= rows[0]["tpot_seconds"]


def split_file(tmp_path, layers, num_layers=6):
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"num_layers": num_layers, "layers": layers}))
    return str(path)


@pytest.mark.parametrize("layers, message", [
    ([{"cache_size": 4, "split_ratio": 0.5}] * 5, "5 layers, but the trace's model has 6"),
    ([{"cache_size": 4, "split_ratio": 0.5}] * 5 + [{"cache_size": 4, "split_ratio": 1.5}],
     "layer 5: split_ratio 1.5: must be a number in (0, 1]"),
    ([{"cache_size": 4, "split_ratio": 0.0}] * 6, "layer 0: split_ratio 0.0: must be a number in (0, 1]"),
    ([{"cache_size": 17, "split_ratio": 0.5}] * 6, "layer 0: 17 cached experts, not in [0, 16]"),
    ([{"cache_size": 4}] * 6, "layer 0: needs an integer cache_size and a number split_ratio"),
    ([{"cache_size": 16, "split_ratio": 1.0}] * 6, "more than the 100 KiB of the test's gpu"),
])
def test_bad_split_files_give_one_line_errors(routed_file, tmp_path, capsys, monkeypatch, layers, message):
    import moe_offload.hardware as hardware_module

    small = profile(gpu=100 * 1024)  # the simulate command resolves --hardware through moe_offload.hardware
    monkeypatch.setattr(hardware_module, "resolve_profile", lambda name: small)
    path = split_file(tmp_path, layers)
    code = main(["simulate", routed_file, "--timed", "--split-config", path])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("moe-offload: error: "), err
    assert path in err and message in err, err


@pytest.mark.parametrize("text, message", [("not json", "line 1: invalid JSON"), ("[]", "no list of layers")])
def test_unreadable_split_files_give_one_line_errors(routed_file, tmp_path, capsys, text, message):
    path = tmp_path / "split.json"
    path.write_text(text)
    code = main(["simulate", routed_file, "--timed", "--split-config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(path) in err and message in err, err
    code = main(["simulate", routed_file, "--timed", "--split-config", str(tmp_path / "missing.json")])
    assert code == 2 and "missing.json: no such file" in capsys.readouterr().err


def test_split_config_replaces_the_cache_size(routed_file, tmp_path, capsys):
    path = split_file(tmp_path, [{"cache_size": 4, "split_ratio": 0.5}] * 6)
    code = main(["simulate", routed_file, "--timed", "--split-config", path, "--cache-size", "25%"])
    assert code == 2 and "leave out --cache-size" in capsys.readouterr().err
    code = main(["simulate", routed_file, "--split-config", path])
    assert code == 2 and "--split-config belongs to the timed simulation" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="the split configuration: 1 layers"):
        simulate_timed(routed_trace(tokens=4), profile(), "lru", split=HALVES)


def test_configure_takes_the_timings_from_the_hardware_unless_given(routed_file, capsys):
    from moe_offload.hardware import resolve_profile

    rtx = resolve_profile("desktop-rtx4090")
    link = rtx.link_from(1)
    assert main(["configure", routed_file, "--vram-budget", "25%", "--hardware", "desktop-rtx4090", "--json",
                 "--expert-load-ms", "0.6"]) == 0
    timings = json.loads(capsys.readouterr().out)["timings_seconds"]
    assert timings == pytest.approx({"expert_load": 6e-4, "expert_compute": rtx.compute.expert_seconds(1, 4096),
                                     "attention": rtx.compute.attention(1),
                                     "moe": 2 * rtx.compute.expert_seconds(1, 4096), "head": rtx.compute.lm_head(1)})
    assert main(["configure", routed_file, "--vram-budget", "25%", "--hardware", "desktop-rtx4090", "--json"]) == 0
    derived = json.loads(capsys.readouterr().out)["timings_seconds"]["expert_load"]
    assert derived == pytest.approx(link.latency_s + 4096 / link.bandwidth_bytes_per_s)


# ------------------------------------------------------------------------ MoEpic's Y, buffer and online loop


def gated_trace(layer_experts, gate, **columns) -> "Trace":
    """One decode token per row; ``layer_experts[t]`` lists token t's expert of each layer (top-1), ``gate``
    is the gate_prediction of every row."""
    from moe_offload.trace.format import Trace, TraceMeta

    experts = np.asarray(layer_experts)[:, :, None]
    tokens, layers = experts.shape[:2]
    meta = TraceMeta(model="hand", num_layers=layers, num_experts=len(gate[0]), top_k=1, expert_bytes=E)
    return Trace.build(meta, experts, gate_prediction=np.tile(np.asarray(gate, float)[None], (tokens, 1, 1)),
                       **columns)


@pytest.mark.parametrize("prefetches, ttft, issued", [(0, 10.0, 0), (1, 10.25, 1), (3, 10.25, 1)])
def test_a_whole_expert_prefetch_waits_for_room_in_the_buffer_of_k_experts_by_hand(prefetches, ttft, issued):
    # Paper 004: the configuration's Y counts the predicted experts whose loads fit the window (equation 11), and
    # they are prefetched, "the bottom segments (or full-size experts)", into the buffer U_b of K complete
    # experts (sections 3.1, 4.1): a whole expert in flight takes a whole expert of it, its top goes to the
    # layer's cache when it lands. Two layers of 4 experts, top-1 (K = 1: a buffer of 100 B), one token routed
    # to expert 0 then expert 2, which layer 1's prediction ranks third (0.4, 0.3, 0.2, 0.1). theta = 1: a top
    # segment is the whole expert (1.5 s over the link), layer 1 caches up to 4 tops, none cached yet.
    #   attention 0 -> 1, router -> 1.25; layer 0's expert 0 loads on demand into the buffer 1.25 -> 2.75 (its
    #   top is cached as it lands), computes 2.75 -> 4.75 and then leaves the buffer.
    #   Y = 0: layer 1's attention 4.75 -> 5.75, router -> 6.0; expert 2 loads on demand 6.0 -> 7.5, computes
    #          -> 9.5, LM head -> 10.0.
    #   Y >= 1: layer 1's first prediction, expert 0, is proposed at 1.25 but waits for the buffer until layer
    #          0's expert has run: 4.75 -> 6.25 (the accounting that cached the top at once started it at 2.75,
    #          when the link was free). At the router, 6.0, it is on the wire and not needed: the demand load of
    #          expert 2 waits for the buffer too, until expert 0 lands at 6.25 and leaves it at once (its layer
    #          passed without it; its top is not cached): 6.25 -> 7.75, computes -> 9.75, LM head -> 10.25.
    #          Y = 3 issues no more: the second and third predictions never find room before the router, which
    #          withdraws them.
    trace = gated_trace([[0, 2]], [[0.4, 0.3, 0.2, 0.1]])
    config = SplitConfig((LayerSplitPlan(1, 1.0, 0), LayerSplitPlan(4, 1.0, prefetches)))
    result = simulate_timed(trace, profile(), "lru", split=config, prefetcher="moepic", timeline_iteration=0)
    assert result.ttft_seconds == pytest.approx(ttft)
    assert (result.prefetches_issued, result.prefetches_used) == (issued, 0)
    later = [("prefetch", 4, 4.75, 6.25), ("demand", 6, 6.25, 7.75)] if prefetches else [("demand", 6, 6.0, 7.5)]
    assert [event[1:] for event in transfers(result)] == [("demand", 0, 1.25, 2.75)] + later  # keys: layer x 4 + j


def test_moepic_without_a_configuration_fills_the_window_as_far_as_the_buffer_allows():
    # No Y given: the loads that complete before the router fires. The window of layer 1 is layer 0's expert
    # (2 s), layer 1's attention (1 s) and router (0.25 s): 3.25 s, floor(3.25 / 1.5) = 2 loads; but the buffer of
    # K = 1 whole expert takes one at a time, from 4.75 (layer 0's expert left it): the timeline of Y >= 1 above.
    trace = gated_trace([[0, 2]], [[0.4, 0.3, 0.2, 0.1]])
    config = SplitConfig((LayerSplitPlan(1, 1.0), LayerSplitPlan(4, 1.0)))
    result = simulate_timed(trace, profile(), "lru", split=config, prefetcher="moepic")
    assert (result.ttft_seconds, result.prefetches_issued) == (pytest.approx(10.25), 1)


def test_the_buffer_of_k_experts_is_shared_a_demand_drops_speculation_a_prefetch_waits():
    from moe_offload.policies import AccessContext
    from moe_offload.policies.lru import LRU
    from moe_offload.simulator.split import SplitExperts

    # Two layers of 4 experts, top-1, theta = 0.2: a bottom segment is 80 B, the buffer K = 1 expert, 100 B.
    plan = SplitConfig((LayerSplitPlan(2, 0.2),) * 2)
    experts = SplitExperts(plan, num_experts=4, top_k=1, expert_bytes=E, make_policy=lambda: LRU(None))
    ctx = AccessContext()
    ctx.pinned = set()
    for key in (0, 4):  # the tops of expert 0 of both layers are cached (whole loads, their bottoms consumed)
        assert experts.reserve(key, ctx, E)
        experts.complete(key, ctx)
        experts.consume(key)
    assert experts.transfer_bytes(4) == 80
    ctx.prefetch = True  # a prefetch of layer 1's expert 0 (its bottom) lands in the buffer
    assert experts.reserve(4, ctx, 80)
    experts.complete(4, ctx)
    assert 4 in experts and experts.buffer.used == 80
    assert not experts.reserve(0, ctx, 80)  # another prefetch waits: 160 B do not fit in 100
    ctx.prefetch, ctx.pinned = False, {0}    # layer 0 needs expert 0 now: the demand drops the speculation
    assert experts.reserve(0, ctx, 80)
    assert 4 not in experts.buffer.resident and experts.buffer.used == 80

    # theta = 0.5, C = 3 in one layer: bottoms of 50 B, so two prefetched bottoms fit in the buffer of K = 1 expert
    # (Y beyond K), a third waits; a whole expert needs all 100 B: it waits while anything is buffered, and its top
    # is cached only once it lands, the whole copy staying in the buffer until it has run.
    experts = SplitExperts(SplitConfig((LayerSplitPlan(3, 0.5),)), num_experts=4, top_k=1, expert_bytes=E,
                           make_policy=lambda: LRU(None))
    ctx.prefetch, ctx.pinned = False, set()
    for key in (0, 1, 2):
        assert experts.reserve(key, ctx, E) and key not in experts.tops[0]
        experts.complete(key, ctx)
        assert key in experts.tops[0] and experts.buffer.used == E
        experts.consume(key)
    ctx.prefetch = True
    assert [experts.transfer_bytes(key) for key in range(4)] == [50, 50, 50, 100]
    assert experts.reserve(0, ctx, 50) and experts.reserve(1, ctx, 50) and not experts.reserve(2, ctx, 50)
    assert not experts.reserve(3, ctx, 100)
    for key in (0, 1):
        experts.complete(key, ctx)
        experts.consume(key)
    assert experts.buffer.used == 0 and experts.reserve(3, ctx, 100) and not experts.reserve(2, ctx, 50)
    experts.complete(3, ctx, layer_now=-1)  # its layer is ahead: the top is cached (evicting LRU's 0) and held
    assert 3 in experts.tops[0] and 0 not in experts.tops[0] and 3 in experts.held and experts.buffer.used == 100
    experts.consume(3)
    experts.release(3)  # layer 0 routed without it: the hold ends
    # a whole copy of expert 0 that lands after its layer was routed without it (layer_now = 0, not pinned) caches
    # no top: the tops stay 1, 2, 3 (the driver drops the copy from the buffer, tiers.py)
    assert experts.transfer_bytes(0) == 100 and experts.reserve(0, ctx, 100)
    experts.complete(0, ctx, layer_now=0)
    assert sorted(experts.tops[0].resident) == [1, 2, 3] and experts.buffer.used == 100 and not experts.held
    with pytest.raises(ConfigError, match="buffer of 2 experts"):
        SplitConfig((LayerSplitPlan(4, 1.0),)).check(1, 4, 2, E, "gpu", 5 * E)  # 4 tops + 2 buffered > 5


def reconfiguration_trace():
    """Two layers of 8 experts, top-1, 12 decode tokens of one request. Tokens 0-5: layer 0 alternates experts
    0 and 1, layer 1 never repeats (2..7); tokens 6-11 the other way round. The prediction is uniform (it ranks
    0, 1, ... and never matters: the windows are empty)."""
    layer0 = [0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    layer1 = [2, 3, 4, 5, 6, 7, 0, 1, 0, 1, 0, 1]
    return gated_trace(list(zip(layer0, layer1)), [[0.125] * 8])


def test_online_reconfiguration_moves_vram_to_the_layer_whose_statistics_ask_for_it():
    # Algorithm 1, by hand. Hardware without compute (attention, experts and LM head take no time), so every
    # prefetch window is empty (Y = 0) and the exposed latency of layer i is (K - m_i) T_load with
    # m_i = max over C >= V_i of K H_i(C) V_i / C. V_e = 2 experts (300 B of VRAM less the 100 B buffer),
    # zeta = 0.25 (steps of 0.5 expert), tau = 6; the run starts uniform: V = (1, 1), theta 0.5, C = 2 each.
    # After 6 tokens: H_0(1) = 0 (one slot, two experts alternating), H_0(C >= 2) = 4/6; H_1 = 0.
    #   V = (1, 1):     m_0 = 4/6 x 1/2 = 1/3 (C = 2), m_1 = 0
    #   probe +0.5:     layer 0 -> m_0 = 4/6 x 0.75 = 1/2 (profit 1/6), layer 1 nothing: layer 0 receives;
    #   probe -0.5:     layer 1 loses nothing: it gives. Moved to (1.5, 0.5): total falls by 1/6 T_load.
    #   next step:      layer 1 cannot give its last 0.5, so VramAllocation stops.
    # Layer 0: C = 2, theta = 0.75; layer 1: C = 1 (m_1 = 0 whatever C: the smallest), theta = 0.5.
    # Applying it: each layer caches its top-C_i experts by LCP priority P = mu rho^(nu/128) (Algorithm 1).
    # Layer 0: experts 0 and 1 (mu 3 each, the rest never activated), its two tops, each 25 B short: 2 transfers
    # of 0.5 s latency and 50 B at 100 B/s, 1.5 s before token 6. Layer 1 (one top): mu = 1 for 2..7, the most
    # recent, 7, ranks first; it is cached already (as LRU would keep it).
    # After 12 tokens the statistics are symmetric (H_0(C >= 2) = H_1(C >= 2) = 4/12, H(1) = 0). VramAllocation
    # goes on from (1.5, 0.5): both layers would profit alike from more, layer 0 is probed first and layer 1
    # cannot give its last 0.5, so the budgets stay; but layer 1 now splits its 0.5 over C = 2 tops
    # (m_1 = 4/12 x 0.25 = 1/12, against 0 with one), theta = 0.25. By priority after 12 tokens layer 0 caches
    # experts 1 and 0 (mu 3 at nu 6 and 7: P = 3 x 0.25^(6/128) = 2.81, 2.79, above mu 1 of experts 2..7), not
    # 6 and 7 that LRU holds: two new tops of 75 B; layer 1 caches 1 and 0 (mu 3, nu 0 and 1): 1 is cached
    # (its ratio shrinks: nothing to load), 0 is a new top of 25 B. 175 B in all.
    from moe_offload.simulator.configurator import configure, measure_statistics, timings_from_profile
    from moe_offload.simulator.timed import Reconfiguration

    trace = reconfiguration_trace()
    hardware = profile(attention=0.0, expert=0.0, lm_head=0.0, router=0.0)
    result = simulate_timed(trace, hardware, "lru", 3 * E, reconfiguration=Reconfiguration(every=6, granularity=0.25))
    first, second = result.reconfigurations
    assert (first["iteration"], first["tokens"], second["tokens"]) == (5, 6, 12)
    assert [(layer["cache_size"], layer["split_ratio"]) for layer in first["layers"]] == [(2, 0.75), (1, 0.5)]
    assert (first["bytes_loaded"], first["seconds"]) == (50, pytest.approx(1.5))
    assert [(layer["cache_size"], layer["split_ratio"]) for layer in second["layers"]] == [(2, 0.75), (2, 0.25)]
    assert second["bytes_loaded"] == 175
    # the online loop read the statistics of the tokens so far: the offline configurator on the first six agrees
    offline = configure(measure_statistics(trace.select(slice(0, 6))), timings_from_profile(hardware, E, 1), 2.0,
                        0.25)
    assert [(split.cache_size, split.split_ratio) for split in offline.layers] == [(2, 0.75), (1, 0.5)]
    onward = configure(measure_statistics(trace), timings_from_profile(hardware, E, 1), 2.0, 0.25, start=[1.5, 0.5])
    assert [(split.cache_size, split.split_ratio) for split in onward.layers] == [(2, 0.75), (2, 0.25)]
    assert any("reran online every 6 tokens: 2 times" in note for note in result.notes)
    assert result.cache_bytes == 3 * E and result.cache_size == 3
    # Token 6 waits 1.5 s for the grown tops, then loads layer 0's expert 2 whole (1.5 s; no compute) and layer
    # 1's expert 0 whole (1.5 s: its one top holds expert 7, LRU's choice).
    assert result.token_latency_seconds[5] == pytest.approx(1.5 + 1.5 + 1.5)


def test_online_reconfiguration_options_and_their_errors(routed_file, capsys):
    from moe_offload.simulator.timed import Reconfiguration

    trace = reconfiguration_trace()
    with pytest.raises(ConfigError, match="tau must be a positive number of tokens"):
        simulate_timed(trace, profile(), "lru", 3 * E, reconfiguration=Reconfiguration(every=0))
    with pytest.raises(ConfigError, match="zeta must be in"):
        simulate_timed(trace, profile(), "lru", 3 * E, reconfiguration=Reconfiguration(every=5, granularity=1.5))
    with pytest.raises(ConfigError, match="a buffer of 1 experts"):
        simulate_timed(trace, profile(), "lru", E, reconfiguration=Reconfiguration(every=5))
    with pytest.raises(ConfigError, match="no gate_prediction column"):
        simulate_timed(hand_trace([[[0]]], layers=1), profile(), "lru", 3 * E,
                       reconfiguration=Reconfiguration(every=5))
    with pytest.raises(ConfigError, match="load time must be positive"):
        simulate_timed(trace, profile(bandwidth=float("inf"), latency=0.0), "lru", 3 * E,
                       reconfiguration=Reconfiguration(every=5))
    out = routed_file.replace(".parquet", ".json")
    assert main(["simulate", routed_file, "--timed", "--policy", "lcp", "--prefetch", "moepic", "--cache-size", "25%",
                 "--reconfigure-every", "20", "--granularity", "0.05", "--timed-json", out]) == 0
    rows = json.loads(open(out).read())
    assert [len(r["reconfigurations"] or []) for r in rows] == [0, 3, 3]  # 60 tokens: at 20, 40 and 60
    assert main(["simulate", routed_file, "--timed", "--granularity", "0.05"]) == 2
    assert "add --reconfigure-every" in capsys.readouterr().err
