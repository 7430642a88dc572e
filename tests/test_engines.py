"""The engines' settings (moe_offload.engines): llama.cpp's layer sets are the best of every set of their size by
the timed simulator (per-layer costs add up, checked against an exhaustive search and on random sets of the
bundled OLMoE and the shared Qwen traces), the printed -ot pattern finds exactly those layers' expert tensors,
KTransformers' masks follow kt_utils.py and its statistics file round-trips through its loader's logic, and a
placement chosen from traffic is scored on traffic it never saw."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from moe_offload.bundled import trace_path
from moe_offload.engines import PlacementContext, run_setting, split_trace
from moe_offload.engines.heldout import served_share
from moe_offload.engines.ktransformers import (front_loading_mask, frequency_mask, random_mask, uniform_mask,
                                              write_statistics)
from moe_offload.engines.ktransformers import settings as kt_settings
from moe_offload.engines.llamacpp import (best_gpu_layers, cpu_layers_regex, expert_tensor_names, layer_gains,
                                         layers_matched)
from moe_offload.engines.llamacpp import settings as llama_settings
from moe_offload.hardware import resolve_profile
from moe_offload.policies import ModelSpec
from moe_offload.reporting.on_engine import measure_on_engine, section_lines
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.schedule import leading_iterations
from moe_offload.trace import read_trace
from moe_offload.trace.format import PREFILL, Trace, TraceMeta
from moe_offload.trace.importers.research import import_routes_json

HARDWARE = resolve_profile("desktop-rtx4090")
QWEN_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # Qwen1.5-MoE-A2.7B: gate, up, down of 2048 x 1408 in bf16


def context_of(trace: Trace, slots: int, tokens: int, expert_bytes: int | None = None) -> PlacementContext:
    meta = trace.meta
    return PlacementContext(ModelSpec(meta.num_layers, meta.num_experts, meta.top_k), slots, trace, HARDWARE,
                            expert_bytes or meta.expert_bytes, timed_tokens=tokens)


def tpot_of(trace: Trace, context: PlacementContext, cpu_layers) -> float:
    result = simulate_timed(trace, HARDWARE, "static-layers", context.slots * context.expert_bytes,
                            expert_bytes=context.expert_bytes, policy_options={"cpu_layers": list(cpu_layers)})
    return result.tpot_seconds


@pytest.mark.parametrize("layers", [[0], [1, 11], [3, 7, 12], list(range(0, 48, 5)), [10, 1, 100 - 53]])
def test_the_ot_pattern_finds_exactly_those_layers_expert_tensors(layers):
    pattern = cpu_layers_regex(layers)
    assert layers_matched(pattern, 48) == set(layers)
    # as a user's llama.cpp reads it: every tensor named blk.N.ffn_{gate,up,down}_exps.weight of those layers
    found = [name for name in expert_tensor_names(48) if re.search(pattern, name)]
    assert found == [f"blk.{n}.ffn_{p}_exps.weight" for n in sorted(layers) for p in ("gate", "up", "down")]
    assert not re.search(pattern, "blk.1.attn_q.weight") and not re.search(pattern, "blk.1.ffn_gate_inp.weight")


def test_the_chosen_layers_are_the_best_of_every_set_on_the_tiny_trace(tiny_trace):
    """Exhaustive: all C(8, 2) = 28 ways to keep 2 of 8 layers in VRAM, each run by the timed simulator."""
    sample = leading_iterations(tiny_trace, 48)
    context = context_of(sample, 16, 48)
    gains, ttft_gains = layer_gains(context)
    chosen = best_gpu_layers(gains, 2, ttft_gains)
    every = {gpu: tpot_of(sample, context, [l for l in range(8) if l not in gpu])
             for gpu in itertools.combinations(range(8), 2)}
    assert every[tuple(chosen)] == pytest.approx(min(every.values()), rel=1e-12)
    base = tpot_of(sample, context, range(8))
    for gpu, tpot in every.items():  # the identity the choice rests on: per-layer costs add up
        assert tpot == pytest.approx(base - gains[list(gpu)].sum(), rel=1e-9)


def check_additive_and_best(trace: Trace, slots: int, expert_bytes: int, seed: int) -> None:
    sample = leading_iterations(trace, 24)
    context = context_of(sample, slots, 24, expert_bytes)
    L = trace.meta.num_layers
    fit = slots // trace.meta.num_experts
    gains, ttft_gains = layer_gains(context)
    chosen = best_gpu_layers(gains, fit, ttft_gains)
    base = tpot_of(sample, context, range(L))
    best = tpot_of(sample, context, [l for l in range(L) if l not in chosen])
    assert best == pytest.approx(base - gains[chosen].sum(), rel=1e-9)
    rng = np.random.default_rng(seed)
    for _ in range(4):  # any other set of the same size: its time is the sum, and never below the chosen one's
        gpu = sorted(rng.choice(L, fit, replace=False).tolist())
        tpot = tpot_of(sample, context, [l for l in range(L) if l not in gpu])
        assert tpot == pytest.approx(base - gains[gpu].sum(), rel=1e-9)
        assert best <= tpot * (1 + 1e-9)
    # and the search over all C(L, fit) sets by the identity finds the same optimum
    optimum = min(gains[list(gpu)].sum() for gpu in itertools.islice(itertools.combinations(range(L), fit), 20000))
    assert gains[chosen].sum() >= optimum - 1e-15


def test_costs_add_up_on_the_bundled_olmoe_trace():
    olmoe = read_trace(trace_path("olmoe"))
    check_additive_and_best(olmoe, 512, olmoe.meta.expert_bytes, seed=0)


def test_costs_add_up_on_the_shared_qwen_trace(qwen_folder):
    qwen = import_routes_json(sorted(qwen_folder.glob("*_[0-9].json")), expert_bytes=QWEN_EXPERT_BYTES,
                              hidden_size=2048)
    check_additive_and_best(qwen, 12 * 60, QWEN_EXPERT_BYTES, seed=1)


def test_llama_cpp_settings_at_a_budget(tiny_trace):
    context = context_of(tiny_trace, 20, 32)  # 20 experts of 8 per layer: 2 layers fit, 6 on the host
    by_label = {s.label: s for s in llama_settings(context)}
    first = by_label["--n-cpu-moe 6"]
    assert first.flags[-2:] == ["--n-cpu-moe", "6"] and first.options == {"cpu_layers": [0, 1, 2, 3, 4, 5]}
    assert first.resident == list(range(6 * 8, 8 * 8))
    ot = next(s for s in by_label.values() if s.kind == "ot")
    assert ot.from_traffic and len(ot.options["cpu_layers"]) == 6
    assert layers_matched(ot.flags[-1].removesuffix("=CPU"), 8) == set(ot.options["cpu_layers"])
    assert by_label["--cpu-moe"].resident == []
    # 20 // 8 = 2 experts of VRAM per layer: one slot and the PR's zero slot
    cache = by_label["--cpu-moe --moe-expert-cache 1 (PR #27861)"]
    assert cache.policy == "lru-dist" and cache.flags[-2:] == ["--moe-expert-cache", "1"] and cache.cache_slots == 8


def test_ktransformers_masks_follow_kt_utils():
    # kt_utils.py: uniform puts masks[layer, :n]; front-loading fills layer after layer from the first
    assert uniform_mask(3, 4, 6) == [0, 1, 4, 5, 8, 9]
    assert front_loading_mask(3, 4, 6) == [0, 1, 2, 3, 4, 5]
    counts = np.array([[0.1, 0.5, 0.3, 0.8], [0.2, 0.4, 0.9, 0.1]])  # kt-kernel's docstring example
    assert frequency_mask(counts, 3) == [1, 3, 6]  # layer0-e3, layer1-e2, layer0-e1
    torch = pytest.importorskip("torch")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(42)
    assert random_mask(3, 4, 6) == sorted(torch.randperm(12, generator=generator)[:6].tolist())


def load_kt_frequency_mask(path, num_layers: int, num_experts: int, num_gpu_experts: int) -> list[int]:
    """A re-implementation of the loader: kvcache-ai/sglang python/sglang/srt/layers/moe/kt_utils.py,
    ``_init_kt_gpu_experts_masks`` with strategy ``frequency`` (torch.load of --init-expert-location, the
    ``logical_count`` of a dict or the tensor itself, 3 dims [buffer, L, J] checked against the model, summed
    over the buffer), then kvcache-ai/ktransformers kt-kernel/python/experts_base.py
    ``generate_gpu_experts_masks`` (torch.topk of the flattened table)."""
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True)
    counts = loaded["logical_count"] if isinstance(loaded, dict) else loaded
    assert counts.dim() == 3 and tuple(counts.shape[1:]) == (num_layers, num_experts)
    freq = counts.sum(dim=0).float()
    _, top = torch.topk(freq.view(-1), k=num_gpu_experts, largest=True, sorted=False)
    mask = torch.zeros(num_layers * num_experts, dtype=torch.bool)
    mask[top] = True
    return torch.nonzero(mask).view(-1).tolist()


def test_the_statistics_file_round_trips_through_the_loader(tmp_path, tiny_trace):
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    counts = rng.permutation(8 * 8).reshape(8, 8) * 3  # no ties: torch.topk's order among equals is unspecified
    path = tmp_path / "kt.pt"
    write_statistics(counts, str(path))
    assert load_kt_frequency_mask(path, 8, 8, 16) == frequency_mask(counts, 16)
    # the setting's own file holds the profile's counts: the loader picks the setting's resident experts
    context = context_of(tiny_trace, 16, 32)
    frequency = next(s for s in kt_settings(context) if s.kind == "frequency")
    frequency.export(str(tmp_path / frequency.export_name))
    table = np.bincount((tiny_trace.experts.astype(np.int64) + np.arange(8)[None, :, None] * 8).ravel(),
                        minlength=64)
    chosen = load_kt_frequency_mask(tmp_path / frequency.export_name, 8, 8, 16)
    # equal counts at the boundary may be taken in another order; the counts served are the same
    assert sorted(table[chosen]) == sorted(table[frequency.resident])


def joined_workloads() -> Trace:
    """Two workloads one after the other: requests 0-9 route mostly to experts 0-3 of each layer, requests
    10-19 to experts 4-7 (a hot set that moves)."""
    rng = np.random.default_rng(3)
    rows, request, iteration, phase = [], [], [], []
    step = 0
    for r in range(20):
        hot = np.arange(4) if r < 10 else np.arange(4, 8)
        for position in range(12):
            layers = []
            for _ in range(2):
                pool = hot if rng.random() < 0.9 else np.arange(8)
                layers.append(sorted(rng.choice(pool, 2, replace=False).tolist()))
            rows.append(layers)
            request.append(r)
            iteration.append(step)
            phase.append(PREFILL if position == 0 else 1)
            step += 1
    meta = TraceMeta(model="joined", num_layers=2, num_experts=8, top_k=2, expert_bytes=1 << 20, hidden_size=256)
    return Trace.build(meta, np.array(rows), request=request, iteration=iteration, phase=phase,
                       position=[i % 12 for i in range(len(rows))])


def test_a_drifting_hot_set_scores_below_hindsight_and_the_report_says_so():
    trace = joined_workloads()
    split = split_trace(trace)
    assert "first 10 of 20 requests" in split.how
    on_engine = measure_on_engine(trace, HARDWARE, 8, 1 << 20, ["ktransformers"], "lru", timed_tokens=64)
    frequency = next(e for e in on_engine.engines[0].scores if e.setting.kind == "frequency")
    spec = ModelSpec(2, 8, 2)
    assert frequency.heldout_served == pytest.approx(served_share(split.scored, frequency.setting.resident, spec))
    assert frequency.heldout_served < frequency.hindsight_served - 0.3
    text = "\n".join(section_lines(on_engine, "joined", "8")["ktransformers"])
    assert "chosen in hindsight (never recommended)" in text and "the hot set drifts" in text
    profile_counts = np.bincount((split.profile.experts.astype(np.int64) + np.array([0, 8])[None, :, None]).ravel(),
                                 minlength=16)
    assert frequency.setting.resident == frequency_mask(profile_counts, 8)  # the profile's choice is the one scored


def test_a_separate_profile_chooses_and_the_whole_trace_scores(tiny_trace):
    split = split_trace(tiny_trace, profile=tiny_trace.select(slice(0, 100)), profile_name="p.parquet")
    assert split.scored is tiny_trace and split.profile.num_tokens == 100 and "p.parquet" in split.how


def test_vllm_offloads_the_tensor_prefix_its_flag_names():
    """uva.py: layers in order, w13 (two thirds of the experts' bytes) before w2, a tensor offloaded while the
    bytes so far are below int(G * 2^30); the printed G offloads exactly the prefix that fits the budget."""
    from moe_offload.engines.vllm import (expert_tensors, gib_for, offloaded_by, offloaded_prefix, settings,
                                          streamed_share)

    L, J, E = 4, 6, 3 * 1000 * 700 * 2
    tensors = expert_tensors(L, J, E)
    assert [(layer, name) for layer, name, _ in tensors[:3]] == [(0, "w13_weight"), (0, "w2_weight"),
                                                                  (1, "w13_weight")]
    assert tensors[0][2] == 2 * J * E // 3 and tensors[0][2] + tensors[1][2] == J * E
    # room for 17 of 24 experts: 7 must go; w13(0) offloads 4, w2(0) 2 more, w13(1) 4 more: three tensors
    assert offloaded_prefix(L, J, E, 17) == 3
    # room for 18: exactly the first layer's two tensors
    assert offloaded_prefix(L, J, E, 18) == 2
    for count in range(1, 2 * L + 1):
        gib = gib_for(tensors, count)
        assert offloaded_by(float(gib), tensors) == count, (count, gib)
    share = streamed_share(tensors, 3, J, E)
    assert share[0] == 1.0 and share[1] == pytest.approx(2 / 3)
    # one pass of two tokens: layer 0 routes {0, 1, 2}, layer 1 {0, 1}: (3 + 2 * 2/3) experts' bytes, 2 tokens
    meta = TraceMeta(model="hand", num_layers=L, num_experts=J, top_k=2, expert_bytes=E)
    routes = np.array([[[0, 1], [0, 1], [0, 1], [0, 1]], [[1, 2], [1, 0], [2, 3], [4, 5]]])
    trace = Trace.build(meta, routes, request=[0, 1], iteration=[0, 0])
    context = PlacementContext(ModelSpec(L, J, 2), 17, trace, HARDWARE, E)
    setting = next(s for s in settings(context) if s.split is not None)
    assert setting.flags[:2] == ["--cpu-offload-gb", gib_for(tensors, 3)]
    assert setting.label.endswith("(layer 0's experts, gate and up of layer 1)")
    assert setting.resident == list(range(2 * J, 4 * J))
    # timed as preloaded split experts: layer 0 caches no top, layer 1 every top at the down projection's third,
    # layers 2 and 3 every expert whole
    plans = [(plan.cached_experts, plan.split_ratio) for plan in setting.split.layers]
    assert plans == [(0, 1.0), (J, pytest.approx(1 / 3)), (J, 1.0), (J, 1.0)] and setting.split.preloaded
    # the pass reads what UVA reads: every routed expert of layer 0 whole, layer 1's gate and up; layers 2 and
    # 3 ({0, 1, 2, 3} and {0, 1, 4, 5}) hit
    result = run_setting(setting, trace, context)
    assert result.bytes_loaded == 3 * E + 2 * (E - round(E / 3))
    assert result.per_layer_accesses == [3, 2, 4, 4] and result.per_layer_hits == [0, 0, 4, 4]
