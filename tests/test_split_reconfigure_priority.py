"""MoEpic's reconfiguration caches each layer's top-C_i experts by cache priority (paper 004, Algorithm 1 and
section 3.4: "ranks all N experts by their cache priorities, and vertically splits the top-C_i experts"), in
the timed simulator (simulator/split.py) and the runtime (runtime/segment_tier.py) alike, instead of letting
a grown cache fill on its next misses."""

import numpy as np
import pytest

from moe_offload.hardware import resolve_profile
from moe_offload.policies import AccessContext
from moe_offload.policies.lru import LRU
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig, SplitExperts
from moe_offload.plan import Reconfiguration
from moe_offload.simulator.timed.reconfigure import OnlineConfigurator
from moe_offload.trace.format import Trace, TraceMeta

LAYERS, EXPERTS, TOP_K = 3, 6, 2  # the runtime tests' tiny Mixtral (tests/model_configs.py)
E = 100
# Layer 0's routing over 5 tokens; layer l routes to (e + l) mod 6.
LAYER0 = [[0, 1], [0, 2], [0, 3], [4, 1], [4, 5]]
# P = mu rho^(nu / omega) after token 4 (rho 0.25, omega 128), layer 0:
#   expert 0: mu 3, nu 2 -> 3 x 0.25^(2/128) = 2.936;  expert 4: mu 2, nu 0 -> 2
#   expert 1: mu 2, nu 1 -> 1.978;  expert 5: mu 1, nu 0 -> 1;  expert 3: nu 2 -> 0.979;  expert 2: nu 3 -> 0.968
RANKED0 = [0, 4, 1, 5, 3, 2]
START = SplitConfig((LayerSplitPlan(2, 0.5),) * LAYERS)
NEW = SplitConfig((LayerSplitPlan(3, 0.5), LayerSplitPlan(2, 0.5), LayerSplitPlan(3, 0.25)))
# layer l's top-C_l: RANKED0 shifted by l, as flat keys
EXPECTED = [[layer * EXPERTS + (e + layer) % EXPERTS for e in RANKED0[:plan.cached_experts]]
            for layer, plan in enumerate(NEW.layers)]
BEFORE = [[0, 2], [EXPERTS + 1, EXPERTS + 3], [2 * EXPERTS + 4, 2 * EXPERTS + 5]]  # the tops cached before


def ranked_tops():
    experts = np.array([[[(e + layer) % EXPERTS for e in token] for layer in range(LAYERS)] for token in LAYER0])
    meta = TraceMeta(model="hand", num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, expert_bytes=E)
    trace = Trace.build(meta, experts)
    configurator = OnlineConfigurator(Reconfiguration(every=100), START, resolve_profile(None), LAYERS, EXPERTS,
                                      TOP_K, E)
    for token in range(len(LAYER0)):
        assert configurator.observe(trace, [token], token) is None  # tau not reached: no configuration
    return configurator.ranked_tops(NEW)


def test_the_priority_ranking_is_equation_4_worked_by_hand():
    assert 3 * 0.25 ** (2 / 128) > 2 > 2 * 0.25 ** (1 / 128) > 1 > 0.25 ** (2 / 128) > 0.25 ** (3 / 128)
    assert ranked_tops() == EXPECTED


def test_the_timed_simulator_caches_exactly_the_top_c_i_and_loads_what_they_lack():
    experts = SplitExperts(START, EXPERTS, TOP_K, E, make_policy=lambda: LRU(None))
    ctx = AccessContext()
    ctx.pinned = set()
    for key in (key for layer in BEFORE for key in layer):  # whole loads: their tops cached, bottoms consumed
        assert experts.reserve(key, ctx, E)
        experts.complete(key, ctx)
        experts.consume(key)
    transfers, nbytes = experts.reconfigure(NEW, ctx, ranked_tops())
    assert [sorted(top.resident) for top in experts.tops] == [sorted(keys) for keys in EXPECTED]
    # layer 0 keeps 0, loads the tops of 4 and 1 (50 B each); layer 1 keeps 7, loads 11; layer 2 (theta 0.25)
    # keeps none of 16, 17 and loads 14, 12, 15 (25 B each)
    assert (transfers, nbytes) == (2 + 1 + 3, 2 * 50 + 50 + 3 * 25)


def test_the_runtime_caches_the_same_tops_and_computes_losslessly_with_them(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from test_runtime_split import NEW_TOKENS, PROMPTS, make_checkpoint, reference

    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine
    from moe_offload.runtime.packing import read_manifest

    root = make_checkpoint(tmp_path)
    expert_bytes = read_manifest(root / "packed").expert_bytes
    with OffloadEngine(make_plan(root / "packed", fast_budget="100%", device="cpu", policy="lru", split_config=START)) as engine:
        split = engine.split
        engine.generate(PROMPTS[0], max_new_tokens=2)
        before = [set(top.resident) for top in split.tops]
        with split.cond:
            assert split.reconfigure(NEW, iteration=2, tokens=5, cached=ranked_tops())
        assert [sorted(top.resident) for top in split.tops] == [sorted(keys) for keys in EXPECTED]
        # read whole: every new top, and every top of layer 2 (its ratio changed); the kept ones are copied
        reads = len(set(EXPECTED[0]) - before[0]) + len(set(EXPECTED[1]) - before[1]) + len(EXPECTED[2])
        assert split.reconfigurations[-1]["bytes_loaded"] == reads * expert_bytes
        result = engine.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS, return_logits=True)
    tokens, logits = reference(root, (24, 24, 12))[PROMPTS[1]]
    assert result.token_ids == tokens
    assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))


def test_the_ranking_keeps_p_s_order_where_p_underflows():
    """After some 65,000 unseen tokens P = mu rho^(nu/omega) is 0.0 in floating point for every such expert; the
    ranking compares log P: log 5 - 99,996 d against log 1 - 99,990 d (d = ln 4 / 128), and log 5 > 6 d."""
    from moe_offload.policies import ModelSpec
    from moe_offload.policies.lcp import LCP

    lcp, ctx = LCP(ModelSpec(1, 2, 1)), AccessContext()
    for token in range(5):  # expert 1: mu 5, last activated at token 4
        ctx.token = token
        lcp.on_access(1, ctx)
    ctx.token = 10  # expert 0: mu 1, at token 10
    lcp.on_access(0, ctx)
    now = 100_000
    assert lcp.priority(0, now) == lcp.priority(1, now) == 0.0
    assert lcp.log_priority(1, now) > lcp.log_priority(0, now)
    assert lcp.log_priority(1, now) - lcp.log_priority(0, now) == pytest.approx(np.log(5) - 6 * np.log(4) / 128)
