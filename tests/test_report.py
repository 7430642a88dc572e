"""`moe-offload report`'s measures: the working set (against naive recounts and LRU's replay), the bound
(against simulate's replay), the verdict."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.reporting.bound import TARGET_HIT_RATES, measure_bound, verdict
from moe_offload.reporting.working_set import measure_working_set, sliding_distinct_kernel, window_lengths
from moe_offload.simulator.stack_distances import LruStack
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.format import Trace, TraceMeta, read_trace


@pytest.fixture(scope="module")
def olmoe():
    return ReplayInput.of(read_trace(DEFAULT_TRACE))


def one_layer_trace(experts, num_experts: int) -> Trace:
    rows = np.asarray(experts, dtype=np.uint8).reshape(-1, 1, 1)
    return Trace.build(TraceMeta("toy", 1, num_experts, 1), rows)


def naive_reuse_distances(keys) -> list:
    """Distinct other keys since the previous request of the same key, by rescanning: O(n^2)."""
    out = []
    for position, key in enumerate(keys):
        before = [p for p in range(position) if keys[p] == key]
        out.append(None if not before else len(set(keys[before[-1] + 1:position]) - {key}))
    return out


def test_reuse_distances_of_a_hand_worked_sequence():
    # 0 1 0 2 1 0: first uses of 0, 1, 2; then 0 after {1}, 1 after {0, 2}, 0 after {2, 1}
    stack = LruStack(4)
    stack.add(np.array([0, 1, 0, 2, 1, 0], np.int64))
    assert stack.histogram.tolist() == [0, 1, 2, 0, 3]


@pytest.mark.parametrize("num_keys,requests", [(5, 400), (40, 1500)])
def test_reuse_distances_equal_a_rescan_through_many_compactions(num_keys, requests):
    # 5 keys have one word of 64 slots, renumbered every 59 requests; 40 keys three words (192 slots), so that
    # a distance adds the marks of later words to those of its own
    keys = np.random.default_rng(3).integers(0, num_keys, requests)
    expected = np.zeros(num_keys + 1, np.int64)
    for distance in naive_reuse_distances(keys.tolist()):
        expected[num_keys if distance is None else distance] += 1
    whole, pieces = LruStack(num_keys), LruStack(num_keys)
    whole.add(keys)
    for piece in np.array_split(keys, 7):  # the stack carried from piece to piece, across the compactions
        pieces.add(piece)
    assert whole.histogram.tolist() == expected.tolist() == pieces.histogram.tolist()


@pytest.mark.parametrize("num_keys,requests", [(5, 400), (40, 1500)])
def test_a_sequence_measured_in_two_parts_at_once_has_the_distances_of_one_pass(num_keys, requests):
    # the later part starts from an empty stack; its first request of each key is resolved against the earlier
    # stack: at every split, including one at each end and one before the last key's first request
    keys = np.random.default_rng(5).integers(0, num_keys - 1, requests)
    keys[requests - requests // 3:] = np.random.default_rng(6).integers(0, num_keys, requests // 3)
    whole = LruStack(num_keys)
    whole.add(keys)
    for split in sorted({0, 1, 17, requests // 2, requests - requests // 3, requests - 5, requests}):
        earlier, later = LruStack(num_keys), LruStack(num_keys)
        earlier.add(keys[:split])
        for piece in np.array_split(keys[split:], 3):
            later.add(piece)
        assert earlier.followed_by(later).tolist() == whole.histogram.tolist()


def test_the_working_set_of_a_trace_in_two_halves_at_once_is_that_of_one_pass(olmoe, monkeypatch):
    from moe_offload.reporting import working_set as module

    one_pass = measure_working_set(olmoe.trace, olmoe.sequence).reuse_histogram
    monkeypatch.setattr(module, "SPLIT_ABOVE", 0)
    halves = [measure_working_set(olmoe.trace, sequence).reuse_histogram for sequence in (olmoe.sequence, None)]
    assert one_pass.tolist() == halves[0].tolist() == halves[1].tolist()
    assert one_pass.sum() == len(olmoe.sequence)


def test_sliding_distinct_equals_a_recount_of_every_window():
    rng = np.random.default_rng(7)
    experts = np.stack([np.stack([rng.choice(6, 2, replace=False) for _ in range(3)]) for _ in range(40)])
    for window in (1, 3, 16, 40):
        total, largest = np.zeros(3, np.int64), np.zeros(3, np.int64)
        sliding_distinct_kernel(experts.astype(np.int64), 6, window, total, largest)
        counts = np.array([[len(set(experts[start:start + window, layer].ravel())) for layer in range(3)]
                           for start in range(40 - window + 1)])
        assert total.tolist() == counts.sum(axis=0).tolist()
        assert largest.tolist() == counts.max(axis=0).tolist()


def test_window_lengths_are_powers_of_four_within_the_trace():
    assert window_lengths(1) == [1]
    assert window_lengths(299) == [1, 4, 16, 64, 256]


def test_reuse_distances_give_lru_hit_rate_at_every_size(olmoe, tiny_trace):
    """Mattson: a request hits LRU with C experts iff its reuse distance is below C."""
    for data in (olmoe, ReplayInput.of(tiny_trace)):
        working_set = measure_working_set(data.trace, data.sequence)
        assert working_set.requests == len(data.sequence)
        for size in (data.spec.top_k, 20, data.spec.num_layers * data.spec.num_experts // 4):
            assert working_set.lru_hit_rate(size) == replay(data, "lru", size).hit_rate


def test_a_short_trace_compiles_no_working_set_kernel_and_the_compiled_ones_agree(olmoe, monkeypatch):
    # under SLIDING_PYTHON_BELOW and REUSE_PYTHON_BELOW requests the plain functions run (no compile); above them
    # the compiled kernels, which give the same numbers
    pytest.importorskip("numba")
    from moe_offload.reporting import working_set as module
    from moe_offload.simulator import stack_distances

    module._sliding_kernel.cache_clear()
    stack_distances._reuse_kernel.cache_clear()
    plain = measure_working_set(olmoe.trace, olmoe.sequence)
    assert module._sliding_kernel.cache_info().currsize == stack_distances._reuse_kernel.cache_info().currsize == 0
    monkeypatch.setattr(module, "SLIDING_PYTHON_BELOW", 1)
    monkeypatch.setattr(stack_distances, "REUSE_PYTHON_BELOW", 1)
    compiled = measure_working_set(olmoe.trace, olmoe.sequence)
    assert module._sliding_kernel.cache_info().currsize == stack_distances._reuse_kernel.cache_info().currsize == 1
    for field in ("distinct_mean", "distinct_max", "reuse_histogram", "layer_counts"):
        assert np.array_equal(getattr(plain, field), getattr(compiled, field)), field


def test_skew_and_pinning_by_hand():
    # one layer: expert 0 three times, 1 twice, 2 once
    trace = one_layer_trace([0, 1, 0, 2, 1, 0], 4)
    working_set = measure_working_set(trace, ReplayInput.of(trace).sequence)
    assert working_set.hottest_share(1).tolist() == [0.5]
    assert working_set.hottest_share(2).tolist() == [5 / 6]
    assert working_set.pinned_hit_rate(2) == 5 / 6
    assert working_set.max_hit_rate() == 0.5  # three first requests of six
    assert working_set.distinct_mean[0].tolist() == [1.0]  # windows of 4: 0102, 1021, 0210: 3 experts each
    assert working_set.distinct_mean[1].tolist() == [3.0]


def test_bound_is_simulates_replay_and_opt_sizes_are_the_smallest(olmoe):
    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    bound = measure_bound(olmoe, 256, working_set, policies=["lru", "lfu", "fifo"])
    assert bound.belady.hits == replay(olmoe, "belady", 256).hits
    assert [r.policy for r in bound.online] == ["lru", "fifo", "lfu"]  # most hits first
    for target in TARGET_HIT_RATES:
        size = bound.needed[target]
        requests = len(olmoe.sequence)
        assert replay(olmoe, "belady", size).hits >= target * requests > replay(olmoe, "belady", size - 1).hits


def test_above_the_threshold_opt_s_curve_is_sampled_and_its_error_at_the_budget_stated(olmoe):
    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    requests = len(olmoe.sequence)
    exact = measure_bound(olmoe, 256, working_set, policies=["lru"], sample_above=None)
    assert exact.opt.exact and exact.opt_error is None and exact.sampling_text() == "exact: every request"
    assert exact.opt.hits(256) == exact.belady.hits
    sampled = measure_bound(olmoe, 256, working_set, policies=["lru"], sample_above=requests // 2)
    assert sampled.opt.rate == 0.5 and sampled.belady.hits == exact.belady.hits  # the replays stay exact
    # the sample holds every request of the sampled experts and none of the others
    kept = [key for key in range(1024) if (key * 0x9E3779B1) % 2**32 < 2**31]
    assert sampled.opt.requests == int(np.isin(olmoe.sequence.expert_id, kept).sum())
    assert sampled.opt_error == pytest.approx(sampled.opt.hit_rate(256) - exact.belady.hit_rate)
    assert f"{sampled.opt_error * 100:+.2f} points from the exact replay's" in sampled.sampling_text()
    assert abs(sampled.opt_error) < 0.05  # half of OLMoE's 1,024 experts: a close estimate
    assert measure_bound(olmoe, 256, working_set, policies=["lru"], sample_above=1).opt.rate == 0.1  # the floor


def test_above_the_replay_threshold_the_replays_run_on_one_sample_the_dist_ones_on_every_request(olmoe):
    working_set = measure_working_set(olmoe.trace)  # streamed: the same measures as from the sequence
    assert working_set.reuse_histogram.tolist() == measure_working_set(olmoe.trace, olmoe.sequence).reuse_histogram.tolist()
    requests = len(olmoe.sequence)
    bound = measure_bound(olmoe, 256, working_set, policies=["lru", "fifo", "lcp", "lru-dist"],
                          sample_above=requests // 2, replay_sample_above=requests // 2)
    assert bound.replay_rate == 0.5 and bound.replay_size == 128 and bound.opt.rate == 0.5
    # independently: the sampled experts' requests, in order, replayed by the policy objects at 128 experts
    kept = np.isin(olmoe.sequence.expert_id, [key for key in range(1024) if (key * 0x9E3779B1) % 2**32 < 2**31])
    sample = olmoe.sequence.expert_id[kept]
    assert bound.belady.accesses == sample.size == bound.opt.requests
    rows = np.flatnonzero(kept) // (16 * 8)  # OLMoE: 16 layers, top-8
    assert ReplayInput.sampled(olmoe.trace, 0.5, "s").sequence.token.tolist() == rows.tolist()
    reference = ReplayInput.sampled(olmoe.trace, 0.5, "s")
    for policy in ("belady", "lru", "fifo", "lcp"):
        result = bound.belady if policy == "belady" else bound.result(policy)
        expected = replay(reference, policy, 128, engine="python")
        assert (result.hits, result.per_layer_hits) == (expected.hits, expected.per_layer_hits), policy
    assert bound.opt.histogram[:128].sum() == bound.belady.hits  # OPT's curve is the sample's own
    assert bound.lru_error == pytest.approx(bound.result("lru").hit_rate - working_set.lru_hit_rate(256))
    assert f"{bound.lru_error * 100:+.2f} points from its exact one" in bound.sampling_text()
    assert bound.replayed_on() == bound.replayed_on("lru") == "50.0% of the experts, at 128"
    # a -dist policy's layers hold 16 experts each, not 8 of a sample's: it replays the whole trace, exactly, and
    # ranks by its hit rate among the sample's
    whole = bound.result("lru-dist")
    expected = replay(ReplayInput.of(olmoe.trace, checked=True), "lru-dist", 256, engine="python")
    assert (whole.accesses, whole.hits, whole.per_layer_hits) == (requests, expected.hits, expected.per_layer_hits)
    assert bound.layer_by_layer == ["lru-dist"] and bound.replayed_on("lru-dist") == "whole trace"
    assert "but the -dist policies' (whole trace, a layer at a time)" in bound.sampling_text()
    rates = [r.hit_rate for r in bound.online]
    assert rates == sorted(rates, reverse=True) and "lru-dist" in [r.policy for r in bound.online]
    # the verdict weighs a whole-trace row against the sample's Belady by hit rates, and counts no hits across them
    alone = measure_bound(olmoe, 256, working_set, policies=["lru-dist"], sample_above=requests // 2,
                          replay_sample_above=requests // 2)
    text = verdict(alone, 1024)
    assert text.startswith(f"lru-dist reaches {whole.hit_rate / alone.belady.hit_rate:.0%} of the hits Belady")
    assert f"leaves {alone.belady.hit_rate - whole.hit_rate:.1%} of the requests on the table" in text


def test_the_verdict_names_a_rival_within_the_sample_s_error():
    from moe_offload.reporting.bound import Bound
    from moe_offload.results import RunResult

    def run(policy, hits, accesses):
        return RunResult(trace="t", policy=policy, cache_size=16, accesses=accesses, hits=hits,
                         misses=accesses - hits)

    # lcp-dist (whole trace, exact) 76.38%; lcp on a sample of a tenth 76.28%, with LRU 0.59 points low there
    belady = run("belady", 8_304, 10_000)
    bound = Bound(cache_size=16, belady=belady, online=[run("lcp-dist", 76_380, 100_000), run("lcp", 7_628, 10_000),
                                                        run("lru", 6_530, 10_000)],
                  replay_rate=0.1, replay_size=2, lru_error=-0.0059, layer_by_layer=["lcp-dist"])
    assert verdict(bound, 64).startswith("lcp-dist (or lcp, 76.28% on the sample against 76.38%: within the "
                                         "sample's error, LRU's -0.59 points) reaches 92% of the hits Belady")
    bound.lru_error = -0.0005  # the sample as good as exact: lcp is behind by more than its error
    assert verdict(bound, 64).startswith("lcp-dist reaches 92% of the hits Belady")
    bound.layer_by_layer = []  # no -dist policy on another footing: nothing to weigh
    assert verdict(bound, 64).startswith("lcp-dist reaches")


def test_verdict_sentences(olmoe):
    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    bound = measure_bound(olmoe, 256, working_set, policies=["lru"])
    lru, opt = bound.online[0], bound.belady
    assert verdict(bound, 1024).startswith(f"lru reaches {lru.hits / opt.hits:.0%} of the hits Belady reaches at "
                                           "256 experts (25.0% of 1,024): the policy leaves "
                                           f"{(opt.hits - lru.hits) / opt.accesses:.1%} of the requests")
    small = measure_bound(olmoe, 16, working_set, policies=["lru"])
    assert verdict(small, 1024).startswith(f"even Belady hits only {small.belady.hit_rate:.0%} at 16 experts")
    assert "no policy helps; buy memory or cut traffic" in verdict(small, 1024)
    large = measure_bound(olmoe, 900, working_set, policies=["lru"])
    assert "the working set, not the policy, limits the hits" in verdict(large, 1024)


def test_policies_without_a_kernel_replay_a_prefix_of_a_large_trace(olmoe, monkeypatch, uncompiled_policy):
    from moe_offload.reporting import bound as bound_module

    monkeypatch.setattr(bound_module, "PYTHON_REPLAY_REQUESTS", 5000)  # olmoe has 38,272 requests
    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    bound = measure_bound(olmoe, 256, working_set, policies=["lru", uncompiled_policy])
    assert [r.policy for r in bound.online] == ["lru"] and [r.policy for r in bound.sampled] == [uncompiled_policy]
    rows = 5000 // (16 * 8)  # whole rows of L * K requests each
    assert bound.sampled_tokens == rows
    prefix = ReplayInput.of(olmoe.trace.select(slice(0, rows)))
    assert bound.sampled[0].hits == replay(prefix, uncompiled_policy, 256).hits
    assert bound.sampled_belady.hits == replay(prefix, "belady", 256).hits
    # LRU on the same rows says how far they are from the whole trace, whose exact LRU the reuse distances give
    lru_prefix, lru_whole = replay(prefix, "lru", 256).hit_rate, replay(olmoe, "lru", 256).hit_rate
    assert bound.sampled_lru.hits == replay(prefix, "lru", 256).hits and bound.lru_exact == lru_whole
    assert bound.prefix_text() == (
        f"{uncompiled_policy} ran on the first {rows} tokens only (`--exact`: the whole trace); "
        f"there LRU hits {lru_prefix:.2%}, "
        f"{(lru_prefix - lru_whole) * 100:+.2f} points from its {lru_whole:.2%} on the whole trace: read them "
        "against LRU's and OPT's rows on the same tokens")


def test_without_the_prefix_a_policy_without_a_kernel_replays_the_whole_trace(olmoe, monkeypatch,
                                                                                 uncompiled_policy):
    from moe_offload.reporting import bound as bound_module

    monkeypatch.setattr(bound_module, "PYTHON_REPLAY_REQUESTS", 5000)
    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    steps = []
    bound = measure_bound(olmoe, 256, working_set, policies=["lru", uncompiled_policy], python_prefix=False,
                          step=steps.append)
    assert sorted(r.policy for r in bound.online) == ["lru", uncompiled_policy] and bound.sampled == []
    assert steps[-1] == (f"the bound: 2 online policies at the budget ({uncompiled_policy} in Python, "
                         "with no compiled kernel: about a hundred times slower), OPT at every size beside them")
    objects = bound.result(uncompiled_policy)
    assert objects.accesses == len(olmoe.sequence) and objects.hits == replay(olmoe, uncompiled_policy, 256).hits


def test_the_bound_says_when_it_waits_for_the_working_set(olmoe):
    from concurrent.futures import Future

    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    for running in (True, False):
        pending = Future()
        pending.done = lambda: not running  # still being measured on its thread, or already there
        pending.result = lambda: working_set
        steps = []
        bound = measure_bound(olmoe, 256, pending, policies=["lru"], step=steps.append)
        assert bound.max_hit_rate == working_set.max_hit_rate()
        waits = steps[-1] == "working set: the rest of its pass over every request"
        assert waits == running


def test_report_exact_lifts_the_prefix_and_the_samples(monkeypatch):
    from moe_offload.cli.main import main
    from moe_offload.reporting import report as report_module

    asked = []

    def spy(*args, **kwargs):
        asked.append({name: kwargs[name] for name in ("sample_above", "replay_sample_above", "python_prefix")})
        raise ConfigError("stopped here")  # what it was asked is all this test reads

    monkeypatch.setattr(report_module, "measure_bound", spy)
    for extra in ([], ["--exact"]):
        assert main(["report", "olmoe", "--fast-memory", "25%", "--jobs", "1", *extra]) != 0
    assert asked[0]["python_prefix"] and asked[0]["sample_above"] is not None
    assert asked[1] == {"sample_above": None, "replay_sample_above": None, "python_prefix": False}


def test_the_first_rows_step_says_why_each_policy_runs_there(olmoe, monkeypatch, uncompiled_policy):
    # lru-objects has no kernel; static-freq and pinned-lru have one, but their placements stay off a sample of the
    # experts, so with the replays sampled they run on the first rows too
    from moe_offload.reporting import bound as bound_module

    monkeypatch.setattr(bound_module, "PYTHON_REPLAY_REQUESTS", 5000)
    working_set = measure_working_set(olmoe.trace, olmoe.sequence)
    half = len(olmoe.sequence) // 2
    steps = []
    bound = measure_bound(olmoe, 256, working_set, policies=["lru", uncompiled_policy, "static-freq", "pinned-lru"],
                          sample_above=half, replay_sample_above=half, step=steps.append)
    assert steps[-1] == (f"the bound: {uncompiled_policy} (no compiled kernel); static-freq, pinned-lru "
                         "(placements, not on a sample) on the first 39 tokens")
    assert sorted(r.policy for r in bound.sampled) == [uncompiled_policy, "pinned-lru", "static-freq"]


def test_a_hit_rate_no_cache_reaches_is_unreachable():
    trace = one_layer_trace([0, 1, 2, 3, 0], 4)  # four first requests of five: at most 20% hits
    data = ReplayInput.of(trace)
    bound = measure_bound(data, 2, measure_working_set(trace, data.sequence), policies=["lru"])
    assert bound.needed == {0.5: None, 0.8: None, 0.9: None}
    assert bound.max_hit_rate == 0.2


def test_a_placement_chosen_in_hindsight_is_a_bound_not_the_verdicts_policy(tiny_trace):
    # static-freq placed from the trace it replays hits more than LRU here; the verdict still names LRU, the
    # best policy a user could run on traffic to come
    data = ReplayInput.of(tiny_trace)
    bound = measure_bound(data, 16, measure_working_set(tiny_trace, data.sequence), policies=["lru", "static-freq"])
    placed = bound.result("static-freq")
    assert placed.in_hindsight and placed.hits > bound.result("lru").hits
    assert bound.best.policy == "lru"
    assert verdict(bound, 64).startswith("lru reaches")


def test_placements_are_not_compared_with_demand_paging_opt(tiny_trace):
    # at every expert, static-layers holds all of them before the first request: 0 requests not served from fast
    # memory, fewer than OPT's cold misses (one per expert); it is placed apart, never a share above 100% of OPT
    from types import SimpleNamespace

    from moe_offload.reporting.report import like_with_like_verdict, policy_rows

    data = ReplayInput.of(tiny_trace)
    bound = measure_bound(data, 64, measure_working_set(tiny_trace, data.sequence),
                          policies=["lru", "static-layers"])
    placed, opt = bound.result("static-layers"), bound.belady
    assert placed.fast_misses == 0 < opt.misses and placed.hits > opt.hits  # what made "103% of OPT's hits"
    text = like_with_like_verdict(bound, 64)
    assert text.startswith("lru reaches 100% of the hits Belady reaches") and "-0." not in text
    assert "static-layers serves 100.0% of the requests from fast memory" in text
    shares = {row[0]: row[2] for row in policy_rows(SimpleNamespace(bound=bound))}
    assert shares == {"belady (OPT)": "100%", "lru": "100%", "static-layers": "placed apart"}
