"""MoEpic's speculative prefetch in the split runtime (runtime/segment_tier.py): a correct prediction turns a demand
load into a prefetch hit, a wrong one is wasted; runs stay lossless against the all-resident model computing with
the same split over budgets, ratios and policies; every access that needs bytes is either a demand load or a used
prefetch; the configuration's Y_i reaches the prefetcher."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from model_configs import tiny_tokenizer  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402
from test_runtime_split import (EXPERTS, INTERMEDIATE, LAYERS, NEW_TOKENS, PROMPTS, config,  # noqa: E402
                                make_checkpoint, memory_bytes, reference)

from moe_offload.models.adapters import load_model  # noqa: E402
from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("split-prefetch"))


def route(engine, layer: int, expert: int, before=None):
    """Layer ``layer`` routed to ``expert`` alone (one token): the accesses, loads and compute of the runner;
    returns what the engine's counters gained since ``before`` (default: this call)."""
    runner = engine.runner
    runner.segment_requests = [0]
    before = before or engine.counters.copy()
    parts = list(runner.layer_experts(layer, [expert], [[1]]))
    assert {e for e, _ in parts} == {expert}
    with engine.split.cond:
        return engine.counters.minus(before)


def predict(engine, layer: int, expert: int):
    """A prediction of ``expert`` for ``layer`` made after layer - 1 was routed; returns the counters from before
    it once it has landed (and its top is cached, when the policy admitted it)."""
    split = engine.split
    before = engine.counters.copy()
    key = layer * EXPERTS + expert
    with split.cond:
        split.propose([(key, 1.0)], layer - 1)
        assert split.cond.wait_for(lambda: key in split.landed and key not in split.tops[layer].reserved,
                                   timeout=RESULT_WAIT_S)
    return before


def test_a_correct_prediction_turns_a_demand_load_into_a_prefetch_hit_and_a_wrong_one_is_wasted(split_checkpoint):
    manifest = read_manifest(split_checkpoint / "packed")
    whole, bottom = manifest.expert_bytes, manifest.expert_bytes * 24 // 48  # theta = 0.5: 24 of 48 rows
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu",
                                 split_config=config([2] * LAYERS, [0.5] * LAYERS))) as engine:
        route(engine, 0, 0)
        unpredicted = route(engine, 1, 3)  # its top was not cached: a miss, the whole expert on demand
        assert (unpredicted.hits, unpredicted.on_demand_loads, unpredicted.prefetches_issued) == (0, 1, 0)

        route(engine, 0, 0)
        before = predict(engine, 1, 4)     # not cached: the whole expert is prefetched, its top cached and held
        assert engine.split.tops[1].held
        predicted = route(engine, 1, 4, before)
        assert (predicted.hits, predicted.on_demand_loads) == (1, 0)
        assert (predicted.prefetches_issued, predicted.prefetches_used, predicted.prefetches_wasted) == (1, 1, 0)
        assert predicted.bytes_per_link == {"ssd->fast": whole}
        assert 1 * EXPERTS + 4 in engine.split.tops[1] and not engine.split.tops[1].held

        route(engine, 0, 0)
        before = predict(engine, 1, 3)     # top cached by its miss above: only the bottom is prefetched
        predicted = route(engine, 1, 3, before)
        assert (predicted.hits, predicted.on_demand_loads, predicted.prefetches_used) == (1, 0, 1)
        assert predicted.bytes_per_link == {"ssd->fast": bottom}

        route(engine, 0, 0)
        before = predict(engine, 1, 5)     # wrong: layer 1 is routed to expert 3 instead (its top is cached:
        wrong = route(engine, 1, 3, before)  # the prefetched top took the place of 4's, LRU's victim)
        assert (wrong.hits, wrong.on_demand_loads, wrong.prefetches_used, wrong.prefetches_wasted) == (1, 1, 0, 1)
        assert wrong.bytes_per_link == {"ssd->fast": whole + bottom}
        assert not engine.split.landed and len(engine.split.buffer.free) == 2  # the wasted copy left the buffer
        assert set(engine.split.tops[1].resident) == {1 * EXPERTS + 3, 1 * EXPERTS + 5} and not engine.split.tops[1].held


def test_a_prefetch_never_takes_a_slot_the_current_layer_needs_and_a_demand_load_drops_speculation(split_checkpoint):
    """Two buffer slots (top-2): two prefetches for layer 1 fill them; layer 1 is then routed to two other experts,
    whose demand loads find the speculation dropped at routing. Layer 0's experts fill the buffer: a prefetch
    proposed meanwhile waits for a slot and lands once they have computed."""
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu",
                                 split_config=config([2] * LAYERS, [0.5] * LAYERS))) as engine:
        split = engine.split
        route(engine, 0, 0)
        predict(engine, 1, 1)
        predict(engine, 1, 2)
        assert not split.buffer.free
        engine.runner.segment_requests = [0]
        before = engine.counters.copy()
        computing = engine.runner.layer_experts(1, [0, 5], [[1], [1]])
        first, _ = next(computing)         # layer 1 computes with experts 0 and 5: both loaded on demand
        with split.cond:
            split.propose([(2 * EXPERTS + 1, 1.0)], 1)
            split.cond.wait_for(lambda: not split.queue.on_wire, timeout=10)
            assert 2 * EXPERTS + 1 not in split.buffer_slot  # both slots hold layer 1's experts
        rest = list(computing)
        assert {first} | {e for e, _ in rest} == {0, 5}
        with split.cond:
            assert split.cond.wait_for(lambda: 2 * EXPERTS + 1 in split.landed, timeout=RESULT_WAIT_S)
            gained = engine.counters.minus(before)
        assert (gained.on_demand_loads, gained.prefetches_wasted, gained.prefetches_issued) == (2, 2, 1)


def test_the_configurations_prefetch_counts_are_the_moepic_prefetchers_y(split_checkpoint):
    split = SplitConfig(tuple(LayerSplitPlan(2, 0.5, y) for y in (3, 1, 4)))
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", prefetch="moepic",
                                 split_config=split)) as engine:
        assert [engine.prefetcher.prefetches_for(layer) for layer in range(LAYERS)] == [3, 1, 4]
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", prefetch="moepic",
                                 split_config=config([2] * LAYERS, [0.5] * LAYERS))) as engine:  # no Y: the link's window
        budget = engine.prefetcher.budget
        assert [engine.prefetcher.prefetches_for(layer) for layer in range(LAYERS)] == [
            min(EXPERTS, int(window // budget.expert_load_seconds)) for window in budget.window_seconds]


def check_counts(engine, result, every_access_loads: bool):
    """issued = used + wasted + the prefetches not used yet; with theta < 1 everywhere every access needs bytes,
    which a demand load or a used prefetch brought."""
    stats, split = result.stats, engine.split
    with split.cond:
        c = engine.counters
        assert c.prefetches_issued == c.prefetches_used + c.prefetches_wasted + len(split.prefetched_unused)
    if every_access_loads:
        assert stats.on_demand_loads + (stats.prefetches_used or 0) == stats.accesses


RATIOS = st.sampled_from([1 / INTERMEDIATE, 0.25, 0.5, 0.73, 1.0])


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cached=st.lists(st.integers(1, EXPERTS), min_size=LAYERS, max_size=LAYERS),
       ratios=st.lists(RATIOS, min_size=LAYERS, max_size=LAYERS), policy=st.sampled_from(["lru", "lfu", "lcp"]),
       prefetches=st.sampled_from([None, 1, 4]))
def test_moepic_prefetching_split_runs_are_lossless_over_budgets_ratios_and_policies(split_checkpoint, cached, ratios,
                                                                                     policy, prefetches):
    rows = tuple(round(theta * INTERMEDIATE) for theta in ratios)
    expected = reference(split_checkpoint, rows)
    split = SplitConfig(tuple(LayerSplitPlan(c, theta, prefetches) for c, theta in zip(cached, ratios)))
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget=f"{memory_bytes(cached, rows)}B", policy=policy,
                                 device="cpu", prefetch="moepic", split_config=split)) as engine:
        for prompt, (tokens, logits) in expected.items():
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == tokens
            assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))
            check_counts(engine, result, all(r < INTERMEDIATE for r in rows))
        outs = engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert [out.token_ids for out in outs] == [expected[prompt][0] for prompt in PROMPTS]


def test_the_oracle_under_replay_prefetches_and_stays_lossless(split_checkpoint):
    """The oracle never mispredicts: with every top cacheable, its prefetches bring bytes that demand loads would
    have, and the tokens and logits are those of the split run without prefetching under the same replay."""
    model, adapter = load_model(split_checkpoint / "model")
    trace = record(model, adapter, tiny_tokenizer(), [Prompt(PROMPTS[1], "p")], model_name="tiny-random",
                   max_new_tokens=8, batch_size=1).trace
    decode = trace.select(np.flatnonzero(trace.phase == 1))
    split = config([EXPERTS] * LAYERS, [0.5] * LAYERS)
    runs = {}
    for prefetch in (None, "oracle"):
        with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", prefetch=prefetch,
                                     replay=decode, replay_weights="router", split_config=split)) as engine:
            runs[prefetch] = engine.generate_replayed(0, return_logits=True)
            check_counts(engine, runs[prefetch], True)
    plain, oracle = runs[None], runs["oracle"]
    assert oracle.token_ids == plain.token_ids
    assert all(torch.equal(a, b) for a, b in zip(oracle.logits, plain.logits))
    assert plain.stats.on_demand_loads == plain.stats.accesses
    assert oracle.stats.prefetches_used > 0 and oracle.stats.on_demand_loads < plain.stats.on_demand_loads
