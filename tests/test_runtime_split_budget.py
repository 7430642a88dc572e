"""MoEpic's Y in a split run is the timed simulator's (issue 25): the runtime's prefetcher gets the budget
``simulate --timed --split`` gives on the same hardware profile, the configuration's Y_i when it has them, else
the loads that fit each layer's window, so both propose the same experts for the same routing."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from model_configs import tiny_tokenizer  # noqa: E402
from test_runtime_split import EXPERTS, LAYERS, PROMPTS, make_checkpoint  # noqa: E402

from moe_offload.hardware import resolve_profile  # noqa: E402
from moe_offload.models.adapters import load_model  # noqa: E402
from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.policies import ModelSpec  # noqa: E402
from moe_offload.prefetch import RoutingView, make_prefetcher  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig  # noqa: E402
from moe_offload.simulator.timed import simulate_timed  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    root = make_checkpoint(tmp_path_factory.mktemp("split-budget"))
    model, adapter = load_model(root / "model")
    trace = record(model, adapter, tiny_tokenizer(), [Prompt(PROMPTS[0], "p")], model_name="tiny-random",
                   max_new_tokens=4, batch_size=1).trace
    return root / "packed", trace


@pytest.mark.parametrize("prefetches", [None, (3, 1, 4)])
def test_a_split_runs_moepic_proposals_are_the_timed_simulators(split_run, prefetches):
    packed, trace = split_run
    hardware = resolve_profile("server-h100-pcie5")
    manifest = read_manifest(packed)
    split = SplitConfig(tuple(LayerSplitPlan(2, 0.5, None if prefetches is None else y)
                              for y in prefetches or [None] * LAYERS))
    simulated = make_prefetcher("moepic", ModelSpec(manifest.num_layers, manifest.num_experts, manifest.top_k))
    simulate_timed(trace, hardware, "lru", expert_bytes=manifest.expert_bytes, prefetcher=simulated, split=split)
    with OffloadEngine(make_plan(packed, fast_budget="100%", device="cpu", prefetch="moepic", hardware=hardware,
                                 split_config=split)) as engine:
        running = engine.prefetcher
        budget = running.budget
        assert budget == simulated.budget
        # by hand: Y_i when given, else floor(window / load) on this profile, at most J
        loads = [min(EXPERTS, int(window // budget.expert_load_seconds)) for window in budget.window_seconds]
        assert [running.prefetches_for(layer) for layer in range(LAYERS)] == list(prefetches or loads)
        assert prefetches is not None or max(loads) > manifest.top_k  # not top-k: the window's count
        for iteration in np.unique(trace.iteration):
            view = RoutingView(trace, int(iteration), np.flatnonzero(trace.iteration == iteration))
            for layer in range(LAYERS):
                view.layer_now = layer
                assert running.on_layer_routed(view) == simulated.on_layer_routed(view)
