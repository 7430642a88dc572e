"""The runtime computes bypassed experts on the host (models/host_experts.py): a miss the fast tier does not
admit is computed from the host tier's copy, and generation stays lossless against the all-resident model,
for one request and for a batch, whatever the budgets; the counters say what was bypassed."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_runtime import NEW_TOKENS, PROMPTS, assert_lossless, checkpoint  # noqa: E402,F401
from waits import RESULT_WAIT_S  # noqa: E402

from moe_offload.api import load  # noqa: E402
from moe_offload.policies import POLICIES, PolicyInfo  # noqa: E402
from moe_offload.policies.lru import LRU  # noqa: E402
from moe_offload.runtime.requests import SamplingParams  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402


class OddLayersOnHost(LRU):
    """LRU that never admits an expert of an odd layer (the host computes those) and places expert 0 of every
    layer before the first token: every path of a bypass, with independently known counts."""

    name = "odd-layers-on-host"
    places_or_bypasses = True

    def admit(self, key, ctx):
        return (key // self.spec.num_experts) % 2 == 0

    def placement(self, slots, trace):
        return [layer * self.spec.num_experts for layer in range(self.spec.num_layers)][:slots]


@pytest.fixture
def on_host(monkeypatch):
    monkeypatch.setitem(POLICIES, OddLayersOnHost.name, PolicyInfo(OddLayersOnHost.name, OddLayersOnHost))
    return OddLayersOnHost.name


@pytest.mark.parametrize("budget, host", [(3, None), (6, None), (4, "40%"), (18, "100%")])
def test_bypassed_experts_computed_on_the_host_are_lossless(checkpoint, on_host, budget, host):  # noqa: F811
    fast = f"{budget * (2 * 48 * 32 + 32 * 48) * 4}B"  # experts of the test model in float32
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=fast, policy=on_host, host_budget=host)) as engine:
        placed = {key for key in (0, 6, 12)[:budget] if key in engine.tiers[0].cache}
        assert len(placed) == min(budget, 3)  # the placement is resident before the first token
        assert_lossless(engine, checkpoint)
        stats = engine.stats
    # layer 1 (the only odd layer of three) is never admitted: each of its accesses is a hit of expert 6
    # (placed) or bypassed; the even layers' accesses are hits or misses
    layer_1 = stats.per_layer_accesses[1]
    assert stats.per_layer_bypassed == [0, layer_1 - stats.per_layer_hits[1], 0]
    assert stats.bypassed == sum(stats.per_layer_bypassed) > 0
    assert stats.hits + stats.misses + stats.bypassed == stats.accesses
    assert stats.host_compute_seconds > 0
    assert stats.tier_requests["host"] == stats.on_demand_loads + stats.bypassed


def test_a_batch_with_bypassed_experts_equals_each_request_alone(on_host):
    prompts = ["User: what is a cache?\nAssistant:", "User: hi\nAssistant:", "def add(a, b):"]
    tokens = [9, 5, 7]
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        alone = [engine.generate(p, max_new_tokens=n, return_logits=True) for p, n in zip(prompts, tokens)]
    with load("tiny", fast_budget="30%", policy=on_host, max_batch=3) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=n, return_logits=True)) for p, n in zip(prompts, tokens)]
        completions = [handle.result(timeout=RESULT_WAIT_S) for handle in handles]
        assert engine.stats.bypassed > 0
    for completion, reference in zip(completions, alone):
        assert completion.finish_reason == "length", completion.error  # an error ends a request with no tokens
        assert completion.token_ids == reference.token_ids
        assert all(torch.equal(a, b) for a, b in zip(completion.logits, reference.logits))
        assert completion.stats.bypassed > 0 and completion.stats.host_compute_seconds > 0


PROMPT, TOKENS = "User: what is a cache?\nAssistant:", 8


@pytest.fixture(scope="module")
def tiny_alone():
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        return engine.generate(PROMPT, max_new_tokens=TOKENS, return_logits=True)


def assert_same(result, reference):
    assert result.token_ids == reference.token_ids
    assert all(torch.equal(a, b) for a, b in zip(result.logits, reference.logits))


def test_static_layers_keeps_the_last_layers_and_computes_the_first_on_the_host(tiny_alone):
    # the tiny model: 8 layers x 8 experts; 25% holds 16 experts, two whole layers: 6 and 7 (llama.cpp's
    # --n-cpu-moe 6 keeps the first six layers' experts in system memory)
    with load("tiny", fast_budget="25%", policy="static-layers", policy_options={"fast_layers": 2}) as engine:
        assert set(engine.tiers[0].cache.resident) == set(range(48, 64))
        result = engine.generate(PROMPT, max_new_tokens=TOKENS, return_logits=True)
    assert_same(result, tiny_alone)
    stats = result.stats
    assert stats.misses == 0 and stats.on_demand_loads == 0 and not stats.bytes_per_link  # nothing moves
    assert stats.per_layer_bypassed == stats.per_layer_accesses[:6] + [0, 0]
    assert stats.per_layer_hits == [0] * 6 + stats.per_layer_accesses[6:]


def test_static_freq_keeps_the_profiles_most_frequent_experts(tiny_alone):
    import numpy as np

    from moe_offload.bundled import TINY_HISTORY_TRACE
    from moe_offload.trace import read_trace

    profile = read_trace(TINY_HISTORY_TRACE)
    counts = np.zeros(64, np.int64)  # how often the profile routes each expert, counted here row by row
    for row in profile.experts:
        for layer, chosen in enumerate(row):
            for expert in chosen:
                counts[layer * 8 + int(expert)] += 1
    top = sorted(range(64), key=lambda key: (-counts[key], key))[:16]
    with load("tiny", fast_budget="25%", policy="static-freq",
              policy_options={"profile": str(TINY_HISTORY_TRACE)}) as engine:
        assert set(engine.tiers[0].cache.resident) == set(top)
        result = engine.generate(PROMPT, max_new_tokens=TOKENS, return_logits=True)
    assert_same(result, tiny_alone)
    stats = result.stats
    assert stats.misses == 0 and stats.bypassed == stats.accesses - stats.hits > 0


def test_a_placement_from_a_profile_needs_one(on_host):
    from moe_offload.errors import ConfigError

    with pytest.raises(ConfigError, match="chooses its experts from a profile"):
        load("tiny", fast_budget="25%", policy="static-freq")
    with pytest.raises(ConfigError, match="cannot hold a layer's top-2 experts"):
        load("tiny", fast_budget="25%", policy=on_host, host_budget="2%")  # one expert


def test_generate_runs_a_placement_and_refuses_bad_placement_options_in_one_line(tmp_path, capsys):
    from test_runtime import one_line_error

    from moe_offload.cli.main import main

    record = tmp_path / "run.json"
    assert main(["generate", "--policy", "static-layers", "--fast-layers", "2", "--fast-budget", "25%",
                 "--max-new-tokens", "3", "--json", str(record), "hi"]) == 0
    assert "computed on the host" in capsys.readouterr().out
    stats = json.loads(record.read_text())
    assert stats["bypassed"] > 0 and stats["misses"] == 0 and stats["host_compute_seconds"] > 0
    bad_trace = tmp_path / "profile.parquet"
    bad_trace.write_text("not a trace")
    for options, problem in ((["--policy", "lru", "--profile", str(bad_trace)], "policy 'lru' takes no profile"),
                             (["--policy", "static-layers", "--fast-layers", "two"], "--fast-layers 'two'"),
                             (["--policy", "static-freq", "--profile", str(tmp_path / "none.parquet")], "no such file"),
                             (["--policy", "static-freq", "--profile", str(bad_trace)], "not a Parquet file"),
                             (["--policy", "static-freq"], "chooses its experts from a profile"),
                             (["--policy", "static-layers", "--fast-layers", "1",
                               "--policy-option", "static-layers.fast_layers=1"], "say the same thing")):
        assert main(["generate", *options, "hi"]) == 2
        assert problem in one_line_error(capsys)
    assert main(["serve", "--policy", "static-layers", "--fast-layers", "-1"]) == 2  # serve checks them alike
    assert "--fast-layers '-1'" in one_line_error(capsys)
    assert main(["generate", "--policy", "static-layers", "--prefetch", "topk", "hi"]) == 2
    assert "nothing for the prefetcher 'topk' to prefetch" in one_line_error(capsys)


def test_metrics_count_bypassed_requests_and_host_compute_seconds():
    pytest.importorskip("fastapi")
    from test_server import metrics, raw

    from moe_offload.server import ServerThread

    with load("tiny", fast_budget="25%", policy="static-layers", max_batch=2) as engine:
        with ServerThread(engine, "tiny") as server:
            body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4}).encode()
            assert raw(server, "/v1/completions", body)[0] == 200
            scraped = metrics(server)
            stats = engine.stats
    assert scraped[("moe_offload_expert_bypassed_total", ())] == stats.bypassed > 0
    assert scraped[("moe_offload_host_compute_seconds_total", ())] == pytest.approx(stats.host_compute_seconds)
    assert stats.host_compute_seconds > 0


@pytest.mark.parametrize("prefetch, host", [(None, None), ("topk", "40%"), ("moepic", None)])
def test_pinned_lru_with_a_prefetcher_is_lossless(checkpoint, tmp_path, prefetch, host):  # noqa: F811
    from moe_offload.trace.format import write_trace

    profile = str(write_trace(checkpoint["history"], tmp_path / "profile.parquet"))
    fast = f"{6 * (2 * 48 * 32 + 32 * 48) * 4}B"  # 6 of 18 experts: 3 pinned, 3 LRU
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=fast, policy="pinned-lru", host_budget=host,
                                 policy_options={"profile": profile}, prefetch=prefetch)) as engine:
        assert len(engine.tiers[0].cache.resident) == 3  # the pinned half, before the first token
        assert_lossless(engine, checkpoint)
        assert engine.stats.bypassed == 0  # it admits every miss


def test_static_layers_below_top_k_computes_every_expert_on_the_host(checkpoint):  # noqa: F811
    # llama.cpp's --cpu-moe: a fast tier of one expert holds no whole layer, so the host computes them all
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=f"{(2 * 48 * 32 + 32 * 48) * 4}B",
                                 policy="static-layers")) as engine:
        assert len(engine.tiers[0].cache) == 0
        assert_lossless(engine, checkpoint)
        stats = engine.stats
    assert stats.hits == stats.misses == 0 and stats.bypassed == stats.accesses
