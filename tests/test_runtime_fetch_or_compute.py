"""Fiddler's fetch-or-compute rule in the runtime (``generate --fetch-or-compute``, runtime/placement.py): a
dynamic policy's miss is computed on the host from the host tier's copy when the hardware profile says that
is faster, per expert and pass; generation stays lossless, the decisions follow the rule's formula worked out
by hand, and they are the timed simulator's on the same rows with the same profile."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_offload.bundled import DEFAULT_TINY_TRACE  # noqa: E402
from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.hardware import HardwareProfile  # noqa: E402
from moe_offload.policies.fetch_or_compute import FetchOrCompute  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.pack_cache import packed_directory  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.runtime.replay import replay_rows  # noqa: E402
from moe_offload.simulator.timed import simulate_timed  # noqa: E402
from moe_offload.trace.format import read_trace  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

REQUEST, NEW_TOKENS = 0, 6  # request 0 of the bundled tiny trace: a 60-token prompt


def profile(*, gpu_expert, host_fixed, host_per_token=0.0, latency=0.0, bandwidth=math.inf) -> HardwareProfile:
    """A GPU and a host holding every expert, one link; linear expert costs on both sides."""
    return HardwareProfile.from_dict({
        "name": "hand",
        "tiers": [{"name": "gpu", "capacity_bytes": 10**12}, {"name": "host", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": bandwidth, "latency_s": latency}],
        "compute": {"attention": {"fixed_s": 1e-4}, "router": {"fixed_s": 1e-5}, "lm_head": {"fixed_s": 1e-4},
                    "expert": {"fixed_s": gpu_expert}},
        "host": {"expert": {"fixed_s": host_fixed, "per_token_s": host_per_token}}})


@pytest.fixture(scope="module")
def tiny():
    packed = packed_directory("tiny")
    trace = read_trace(DEFAULT_TINY_TRACE)
    with OffloadEngine(make_plan(packed, replay=trace, fast_budget="100%", preload=True)) as engine:
        reference = engine.generate_replayed(REQUEST, NEW_TOKENS, return_logits=True)
    return packed, trace, reference


@pytest.fixture
def decisions(monkeypatch):
    """Every decision of the rule, by anyone, as (key, tokens routed to it, fetched)."""
    made = []
    decide = FetchOrCompute.__call__

    def spy(self, key, ctx):
        fetched = decide(self, key, ctx)
        made.append((int(key), sum(ctx.routed.values()), fetched))
        return fetched

    monkeypatch.setattr(FetchOrCompute, "__call__", spy)
    return made


def run(tiny, hardware, fast_budget="25%", **options):
    packed, trace, reference = tiny
    with OffloadEngine(make_plan(packed, replay=trace, fast_budget=fast_budget, policy="lru", fetch_or_compute=True,
                                 hardware=hardware, **options)) as engine:
        result = engine.generate_replayed(REQUEST, NEW_TOKENS, return_logits=True)
    assert result.token_ids == reference.token_ids  # lossless against the all-resident engine
    assert all(torch.equal(a, b) for a, b in zip(result.logits, reference.logits))
    assert result.stats.admission == "fetch-or-compute"
    return result.stats


def test_a_pass_fetches_an_expert_with_many_tokens_and_computes_one_with_few_on_the_host(tiny, decisions):
    # latency 0, free bandwidth: fetch(k, n) = 10 ms on the GPU; compute(k, n) = 0.5 ms + 1 ms x n on the host.
    # Fetched iff 10 <= 0.5 + n, so iff n >= 10: the prompt's popular experts are fetched, decoding computes
    # every miss on the host
    stats = run(tiny, profile(gpu_expert=10e-3, host_fixed=0.5e-3, host_per_token=1e-3))
    assert decisions and all(fetched == (tokens >= 10) for _, tokens, fetched in decisions)
    assert any(fetched for *_, fetched in decisions) and any(not fetched for *_, fetched in decisions)
    assert all(not fetched for _, tokens, fetched in decisions if tokens == 1)
    assert stats.bypassed == sum(not fetched for *_, fetched in decisions)
    assert stats.misses == sum(fetched for *_, fetched in decisions)
    assert stats.host_compute_seconds > 0


@pytest.mark.parametrize("prefetch", ["topk", "oracle"])
def test_a_prefetcher_beside_the_rule_stays_lossless(tiny, decisions, prefetch):
    # the rule decides the demand misses; what the prefetcher brings in is used as any resident expert. How many
    # misses remain depends on whether the link beats the compute on this machine (the oracle's prefetches can
    # all land in time), so what is asserted holds under any timing: every miss left that is not already on the
    # wire as a prefetch is the rule's to decide, and each bypass is one of its decisions to compute on the host
    stats = run(tiny, profile(gpu_expert=10e-3, host_fixed=0.5e-3, host_per_token=1e-3), prefetch=prefetch)
    assert stats.prefetches_issued > 0
    assert stats.bypassed == sum(not fetched for *_, fetched in decisions)
    assert stats.misses >= sum(fetched for *_, fetched in decisions)  # the rest waited for a prefetch in flight
    assert stats.hits + stats.misses + stats.bypassed == stats.accesses


def test_a_small_host_tier_reads_a_bypassed_expert_into_it_first(tiny):
    # a host tier of 6 experts: most bypassed experts are not in it, and go from the files into it (no further)
    # before the layer computes them there; the host tier's requests count each of them
    stats = run(tiny, profile(gpu_expert=10e-3, host_fixed=0.5e-3, host_per_token=1e-3), host_budget="10%")
    assert stats.bypassed > 0 and stats.tier_requests["host"] == stats.on_demand_loads + stats.bypassed
    assert stats.tier_hits["host"] < stats.tier_requests["host"]  # some were read from the files first


E, HIDDEN = 442368, 192  # the tiny model's expert (float16, stored) and hidden size
# a link of 1 GB/s and 10 us: fetch = 10 us + E / 1e9 + GPU 10 us = 462.4 us; compute = 2 x (10 us + n x HIDDEN
# x 2 B / 1e9) + host fixed, at most 2 x 33 us + host fixed for the 60-token prompt
CHEAP, DEAR = 10e-6, 10e-3


@pytest.mark.parametrize("host_fixed", [CHEAP, DEAR])
def test_a_host_far_cheaper_computes_every_miss_there_and_one_far_dearer_none(tiny, decisions, host_fixed):
    fetch = 10e-6 + E / 1e9 + 10e-6
    compute_prompt = 2 * (10e-6 + 60 * HIDDEN * 2 / 1e9) + host_fixed
    assert (compute_prompt < fetch) == (host_fixed == CHEAP)  # the hand-worked sides, for any n <= 60
    stats = run(tiny, profile(gpu_expert=10e-6, host_fixed=host_fixed, latency=10e-6, bandwidth=1e9))
    assert decisions and all(fetched == (host_fixed == DEAR) for *_, fetched in decisions)
    if host_fixed == CHEAP:  # nothing is ever admitted: the fast tier stays empty, every request is computed on the host
        assert stats.hits == stats.misses == 0 and stats.bypassed == stats.accesses
    else:
        assert stats.bypassed == 0 and stats.misses > 0 and stats.host_compute_seconds == 0


def test_the_runtime_decides_as_the_timed_simulator_on_the_same_rows(tiny, decisions):
    # Half the experts fit: what the run fetches (32 experts) is never evicted, so both caches hold the same
    # experts at every access and the rule is asked about the same misses. (With evictions the victims would
    # depend on the order the loads land in, which is the machine's timing, not the rule.)
    # A link of 100 MB/s: the expert's stored bytes (4.4 ms) and the hidden states' count in the costs.
    packed, trace, _ = tiny
    hardware = profile(gpu_expert=6e-3, host_fixed=0.5e-3, host_per_token=1e-3, latency=1e-5, bandwidth=1e8)
    stats = run(tiny, hardware, fast_budget="50%")
    assert 0 < stats.misses <= 32 and stats.bypassed > 0
    in_runtime = sorted(decisions)
    decisions.clear()
    m = read_manifest(packed)
    simulated = simulate_timed(trace.select(replay_rows(trace, REQUEST, NEW_TOKENS)), hardware, "lru",
                               cache_bytes=32 * m.expert_bytes, expert_bytes=m.expert_bytes, fetch_or_compute=True)
    assert sorted(decisions) == in_runtime
    assert (simulated.hits, simulated.misses, simulated.bypassed) == (stats.hits, stats.misses, stats.bypassed)
    assert simulated.per_layer_bypassed == stats.per_layer_bypassed


def test_fetch_or_compute_is_refused_where_it_cannot_run(tiny):
    packed, trace, _ = tiny
    no_host = profile(gpu_expert=1e-3, host_fixed=1e-3)
    no_host = HardwareProfile(**{**no_host.__dict__, "host": None})
    for options, problem in (({"hardware": no_host}, "has no [host] compute"),
                             ({"policy": "static-layers"}, "is a static placement that loads none")):
        with pytest.raises(ConfigError, match=problem.replace("[", r"\[").replace("]", r"\]")):
            OffloadEngine(make_plan(packed, **{"fast_budget": "25%", "fetch_or_compute": True, **options}))


def test_generate_and_serve_take_fetch_or_compute_and_refuse_bad_input_in_one_line(tmp_path, capsys):
    import json

    from test_runtime import one_line_error

    from moe_offload.cli.main import main

    cheap_host = tmp_path / "cheap-host.toml"  # the CHEAP profile above, as a file: every miss on the host
    cheap_host.write_text('name = "cheap-host"\n'
                          '[[tiers]]\nname = "gpu"\ncapacity_bytes = "1 TB"\n'
                          '[[tiers]]\nname = "host"\ncapacity_bytes = "1 TB"\n'
                          '[[links]]\nfrom = "host"\nto = "gpu"\nbandwidth_bytes_per_s = 1e9\nlatency_s = 10e-6\n'
                          '[compute]\nattention = { fixed_s = 1e-4 }\nrouter = { fixed_s = 1e-5 }\n'
                          'lm_head = { fixed_s = 1e-4 }\nexpert = { fixed_s = 10e-6 }\n'
                          '[host]\nexpert = { fixed_s = 10e-6 }\n')
    record = tmp_path / "run.json"
    assert main(["generate", "--fetch-or-compute", "--hardware", str(cheap_host), "--fast-budget", "25%",
                 "--max-new-tokens", "3", "--json", str(record), "hi"]) == 0
    stats = json.loads(record.read_text())
    assert stats["admission"] == "fetch-or-compute" and stats["bypassed"] == stats["accesses"] > 0
    no_host = tmp_path / "no-host.toml"
    no_host.write_text(cheap_host.read_text().split("[host]")[0])
    for command in ("generate", "serve"):
        for options, problem in ((["--hardware", str(no_host)], "hardware cheap-host has no [host] compute"),
                                 (["--policy", "static-layers"], "policy 'static-layers' is a static placement"),
                                 (["--hardware", "nowhere"], "unknown hardware preset 'nowhere'")):
            assert main([command, "--fetch-or-compute", *options] + (["hi"] if command == "generate" else [])) == 2
            assert problem in one_line_error(capsys)
    assert main(["serve", "--hardware", str(tmp_path / "none.toml")]) == 2  # serve reads --hardware first too
    assert "none.toml" in one_line_error(capsys)


def test_a_batch_decides_on_the_tokens_each_expert_gets_in_the_pass(decisions):
    # fetch 2.5 ms against 0.5 ms + 1 ms x n on the host: fetched iff n >= 2, so in a pass of three decoding
    # requests an expert two or three of them route to is fetched and one routed by a single request is not
    from moe_offload.api import load
    from moe_offload.runtime.requests import SamplingParams

    prompts = ["User: what is a cache?\nAssistant:", "User: hi\nAssistant:", "def add(a, b):"]
    tokens = [9, 5, 7]
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        alone = [engine.generate(p, max_new_tokens=n, return_logits=True) for p, n in zip(prompts, tokens)]
    decisions.clear()
    with load("tiny", fast_budget="30%", policy="lru", max_batch=3, fetch_or_compute=True,
              hardware=profile(gpu_expert=2.5e-3, host_fixed=0.5e-3, host_per_token=1e-3)) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=n, return_logits=True)) for p, n in zip(prompts, tokens)]
        completions = [handle.result(timeout=RESULT_WAIT_S) for handle in handles]
    for completion, reference in zip(completions, alone):
        assert completion.token_ids == reference.token_ids
        assert all(torch.equal(a, b) for a, b in zip(completion.logits, reference.logits))
    assert all(fetched == (n >= 2) for _, n, fetched in decisions)
    assert {(n, fetched) for _, n, fetched in decisions} >= {(1, False), (2, True)}
