"""LLRU in the split runtime (runtime/split.py) counts rounds as the replay does (paper 001, Definition 2: K
requests per layer per token): each layer's cache of tops sees, for every access, the replay's clock of that
expert's first request in the pass, and evicts what a replay of the same sequence through per-layer LLRU
caches of the same size evicts."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from llru_clocks import spy_on_llru  # noqa: E402
from test_runtime_split import EXPERTS, LAYERS, TOP_K, config, make_checkpoint  # noqa: E402

from moe_offload.policies import AccessContext, ModelSpec  # noqa: E402
from moe_offload.policies.llru import LLRU  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.simulator.cache import ExpertCache  # noqa: E402
from moe_offload.trace.flatten import flatten  # noqa: E402
from moe_offload.trace.format import DECODE, Trace, TraceMeta  # noqa: E402

# one token per pass, top-2; layer l routes token t to (a + l, b + l) mod 6 for the pair (a, b) below
PAIRS = [(0, 1), (2, 3), (0, 4), (1, 2), (3, 0), (4, 5), (1, 0), (2, 4)]
TOPS = 2  # cached tops per layer: most tokens evict


def sequence() -> Trace:
    experts = np.array([[[(a + layer) % EXPERTS, (b + layer) % EXPERTS] for layer in range(LAYERS)]
                        for a, b in PAIRS])
    meta = TraceMeta(model="hand", num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, expert_bytes=1)
    return Trace.build(meta, experts, phase=[DECODE] * len(PAIRS), iteration=list(range(len(PAIRS))))


def replay_victims(trace: Trace) -> list[tuple[int, int]]:
    """(token, key) of every eviction of a replay through per-layer caches of TOPS experts with LLRU: request t
    has the replay's clock t (trace/flatten.py)."""
    spec = ModelSpec(LAYERS, EXPERTS, TOP_K)
    caches = [ExpertCache(TOPS, LLRU(spec)) for _ in range(LAYERS)]
    victims = []
    ctx = AccessContext()
    for cache in caches:
        cache.on_evict = lambda key: victims.append((ctx.token, key))
    flat = flatten(trace)
    for clock, (layer, key, token) in enumerate(zip(flat.layer.tolist(), flat.expert_id.tolist(),
                                                    flat.token.tolist())):
        ctx.clock, ctx.layer, ctx.token = clock, layer, token
        caches[layer].request(key, ctx)
    return victims


def test_the_split_runners_llru_sees_the_replays_clocks_and_evicts_what_the_replay_evicts(tmp_path, monkeypatch):
    victims = []
    seen = spy_on_llru(monkeypatch, victims)
    trace = sequence()
    root = make_checkpoint(tmp_path)
    with OffloadEngine(make_plan(root / "packed", fast_budget="100%", device="cpu", policy="test-llru", replay=trace,
                                 replay_weights="router", split_config=config([TOPS] * LAYERS, [0.5] * LAYERS))) as engine:
        engine.generate_replayed(0)
    flat = flatten(trace)
    # one token per pass: each expert's only request in its pass, at the replay's clock round * L + layer
    expected = [(token, key, clock) for clock, (token, key) in enumerate(zip(flat.token.tolist(),
                                                                            flat.expert_id.tolist()))]
    assert sorted(seen) == sorted(expected)
    # the same experts leave in the same pass (within a pass the runtime evicts as its loads land)
    assert sorted(victims) == sorted(replay_victims(trace))
    assert {key // EXPERTS for _, key in victims} == set(range(LAYERS)) and len(victims) >= 3 * LAYERS
