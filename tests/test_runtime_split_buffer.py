"""The split runtime's buffer counts bytes (runtime/tiers.py SegmentPool, runtime/segment_tier.py): a whole-expert
slot holds floor(E / b) bottoms of b bytes, is whole again once they are all back, and with MoEpic's Y > K more
than K prefetched bottoms land ahead of their layers and are used without a demand load."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from test_runtime_split import EXPERTS, LAYERS, NEW_TOKENS, PROMPTS, TOP_K, config, make_checkpoint, reference  # noqa: E402
from test_runtime_split_prefetch import route  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.runtime.tiers import SegmentPool  # noqa: E402
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig  # noqa: E402


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("split-buffer"))


def test_a_slot_is_carved_into_as_many_equal_ranges_as_fit_and_is_whole_again_when_they_are_back():
    pool = SegmentPool(2, 12, torch.float32, torch.device("cpu"))
    fives = [pool.take(5) for _ in range(4)]  # 12 // 5 = 2 per slot: both slots carved
    assert sorted(fives) == [(0, 0), (0, 5), (1, 0), (1, 5)]
    assert not pool.free and not pool.fits(5) and not pool.fits(4) and not pool.fits()
    pool.give_back((0, 5))
    assert pool.fits(5) and not pool.fits(4) and not pool.fits()  # a carved range serves its own size alone
    assert pool.take(5) == (0, 5)
    for taken in fives:
        pool.give_back(taken)
    assert sorted(pool.free) == [0, 1]
    whole = pool.take()
    other = 1 - whole[0]
    assert whole[1] == 0 and [pool.take(3) for _ in range(4)] == [(other, 0), (other, 3), (other, 6), (other, 9)]
    assert not pool.fits(3)
    pool.region((other, 6))[:3] = torch.tensor([1.0, 2.0, 3.0])
    assert pool.memory[other, 6:9].tolist() == [1.0, 2.0, 3.0]


def test_with_y_above_k_four_bottoms_land_ahead_of_two_layers_and_none_is_loaded_on_demand(split_checkpoint):
    """theta = 0.5: a bottom is half an expert, so the buffer of K = 2 experts holds 4 bottoms (2 per slot). Four
    prefetched bottoms, two for layer 1 and two for layer 2, all land before layer 1 is routed; each layer then
    computes with its two without a demand load, and 4 bottoms' bytes moved."""
    bottom = read_manifest(split_checkpoint / "packed").expert_bytes // 2
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu",
                                 split_config=config([EXPERTS] * LAYERS, [0.5] * LAYERS))) as engine:
        split = engine.split
        for layer in (1, 2):
            for expert in (0, 1):
                route(engine, layer, expert)  # a miss: the whole expert, its top cached (every top fits)
        route(engine, 0, 0)
        before = engine.counters.copy()
        keys = [layer * EXPERTS + expert for layer in (1, 2) for expert in (0, 1)]
        with split.cond:
            split.propose([(key, 1.0) for key in keys], 0)
            assert split.cond.wait_for(lambda: all(key in split.landed for key in keys), timeout=RESULT_WAIT_S)
            assert len(split.landed) == 4 > TOP_K and not split.buffer.free
        engine.runner.segment_requests = [0]
        for layer in (1, 2):
            assert {e for e, _ in engine.runner.layer_experts(layer, [0, 1], [[1], [1]])} == {0, 1}
        with split.cond:
            gained = engine.counters.minus(before)
        assert (gained.on_demand_loads, gained.prefetches_issued, gained.prefetches_used) == (0, 4, 4)
        assert gained.prefetches_wasted == 0 and gained.hits == 4
        assert gained.bytes_per_link == {"ssd->fast": 4 * bottom}
        assert not split.landed and len(split.buffer.free) == TOP_K


def test_moepic_with_y_above_k_is_lossless_and_lands_more_bottoms_than_k(split_checkpoint):
    """Every top cached at theta = 0.5 and Y = 4 > K = 2: the run gives the split reference's tokens and logits,
    and every access is a demand load or a used prefetch."""
    rows = (24,) * LAYERS
    expected = reference(split_checkpoint, rows)
    split = SplitConfig(tuple(LayerSplitPlan(EXPERTS, 0.5, 4) for _ in range(LAYERS)))
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", prefetch="moepic",
                                 split_config=split)) as engine:
        assert [engine.prefetcher.prefetches_for(layer) for layer in range(LAYERS)] == [4] * LAYERS
        for prompt in PROMPTS:
            tokens, logits = expected[prompt]
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == tokens
            assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))
            assert result.stats.on_demand_loads + result.stats.prefetches_used == result.stats.accesses
            assert result.stats.prefetches_issued > 0


def test_a_split_run_with_a_host_tier_has_a_worker_per_link(split_checkpoint):
    """One data path: the link into the split's fast tier and the link into the host tier each have their worker,
    and the engine's data path is the one the split tier belongs to."""
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", host_budget="100%",
                                 split_config=config([2] * LAYERS, [0.5] * LAYERS))) as engine:
        assert [worker.link.name for worker in engine.path.workers] == ["host->fast", "ssd->host"]
        assert engine.path.tiers[0] is engine.split and engine.split.path is engine.path
        assert all(worker.is_alive() for worker in engine.path.workers)
