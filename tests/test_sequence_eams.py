"""MoE-Infinity's per-sequence EAMs on a trace recorded with batches (rows of several requests interleaved,
prefills of many tokens): the counts the policy and the prefetcher hold for each sequence when it ends are
its tokens per expert, counted independently from the trace (prefetch.eam.sequence_eams)."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from model_configs import build, tiny_tokenizer  # noqa: E402

from moe_offload.hardware import HardwareProfile  # noqa: E402
from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.policies.moe_infinity import SequenceEAMs  # noqa: E402
from moe_offload.prefetch.eam import sequence_eams  # noqa: E402
from moe_offload.prefetch.moe_infinity import MoEInfinityPrefetcher  # noqa: E402
from moe_offload.simulator.replay import ReplayInput, replay  # noqa: E402
from moe_offload.simulator.timed import Arrivals, simulate_timed  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402

E = 100
PROMPTS = [Prompt("def add(a, b):", "t:0"), Prompt("The quick brown fox jumps over", "t:1"),
           Prompt("User: what is a cache?\nAssistant:", "t:2"), Prompt("for i in range(10):", "t:3")]
BATCH = 3


@pytest.fixture(scope="module")
def batch_trace():
    model, adapter = build("mixtral")
    trace = record(model, adapter, tiny_tokenizer(), PROMPTS, model_name="m", max_new_tokens=6,
                   batch_size=BATCH).trace
    first_iteration = trace.request[trace.iteration == trace.iteration[0]]
    assert len(set(first_iteration.tolist())) == BATCH and (np.diff(trace.request) != 0).sum() > len(PROMPTS)
    return trace


@pytest.fixture
def ended_eams(monkeypatch):
    """{request: its EAM as the policy held it when the request ended}, and the most sequences held at once."""
    ended, most = {}, [0]
    original = SequenceEAMs.end

    def end(self, request):
        if request in self.by_request:
            assert request not in ended
            ended[request] = np.array(self.by_request[request])
            most[0] = max(most[0], len(self.by_request))
        original(self, request)
    monkeypatch.setattr(SequenceEAMs, "end", end)
    return ended, most


def expected_counts(trace):
    requests, eams = sequence_eams(trace)
    return dict(zip(requests.tolist(), eams))


def hardware_with_host_cache(expert_bytes_in_all):
    """gpu, a host tier too small for every expert (a cache with its own policy), ssd at home."""
    return HardwareProfile.from_dict({
        "name": "three-tiers",
        "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": expert_bytes_in_all // 2},
                  {"name": "ssd", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": 1e4, "latency_s": 1e-3},
                  {"from": "ssd", "to": "host", "bandwidth_bytes_per_s": 5e3, "latency_s": 1e-3}],
        "compute": {"attention": {"fixed_s": 1e-3}, "router": {"fixed_s": 1e-4}, "expert": {"fixed_s": 1e-3},
                    "lm_head": {"fixed_s": 1e-3}}})


def test_replay_counts_each_sequence_s_tokens(batch_trace, ended_eams):
    ended, most = ended_eams
    replay(ReplayInput.of(batch_trace), "moe-infinity", 6, engine="python")  # the objects: their EAMs
    expected = expected_counts(batch_trace)
    assert ended.keys() == expected.keys()
    for request, eam in ended.items():
        np.testing.assert_array_equal(eam, expected[request], err_msg=f"request {request}")
    assert most[0] == BATCH  # the running sequences only


@pytest.mark.parametrize("arrivals", [Arrivals(), Arrivals("poisson", rate=50.0, max_batch=2)],
                         ids=["as-recorded", "continuous-batching"])
def test_timed_counts_prefill_and_batched_tokens_once_over_the_tiers(batch_trace, ended_eams, arrivals):
    ended, most = ended_eams
    meta = batch_trace.meta
    hardware = hardware_with_host_cache(meta.num_layers * meta.num_experts * E)
    result = simulate_timed(batch_trace, hardware, "moe-infinity", 4 * E, expert_bytes=E, arrivals=arrivals)
    assert result.bytes_per_link["ssd->host"] > 0  # the host tier was a cache, with the shared EAMs
    expected = expected_counts(batch_trace)
    assert ended.keys() == expected.keys()
    for request, eam in ended.items():
        np.testing.assert_array_equal(eam, expected[request], err_msg=f"request {request}")
    assert most[0] == min(BATCH, arrivals.max_batch)


def test_the_prefetcher_keeps_each_sequence_s_eam_until_it_ends(batch_trace, monkeypatch):
    ended = {}
    original = MoEInfinityPrefetcher.on_request_end

    def on_request_end(self, request):
        ended[request] = self.current_eam(request).copy()
        original(self, request)
        assert request not in self._current
    monkeypatch.setattr(MoEInfinityPrefetcher, "on_request_end", on_request_end)
    meta = batch_trace.meta
    simulate_timed(batch_trace, hardware_with_host_cache(meta.num_layers * meta.num_experts * E), "lru", 4 * E,
                   expert_bytes=E, prefetcher="moe-infinity", history=batch_trace)
    expected = expected_counts(batch_trace)
    assert ended.keys() == expected.keys()
    for request, eam in ended.items():
        np.testing.assert_array_equal(eam, expected[request], err_msg=f"request {request}")
