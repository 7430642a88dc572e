"""Exact agreement with libCacheSim, a second implementation, on the miss counts of LRU, FIFO, Belady and ARC,
replayed through the Python policy objects and through the compiled kernels (where Numba is installed; all four
have one).

(libCacheSim's LeCaR is not compared: it draws its random choices from its own generator, keeps one history
for both experts and restarts a returning key's count, so only the distribution of its misses could agree.)"""

from __future__ import annotations

import pytest

from conftest import QWEN_FILES
from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.policies import POLICIES
from moe_offload.simulator import kernels
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.flatten import write_oracle_general
from moe_offload.trace.format import read_trace
from moe_offload.trace.importers import import_routes_json
from moe_offload.trace.synthetic import zipf_trace

lcs = pytest.importorskip("libcachesim")

LIBCACHESIM = {"lru": "LRU", "fifo": "FIFO", "belady": "Belady", "arc": "ARC"}


@pytest.fixture(params=["python", "compiled"])
def engine(request):
    if request.param == "compiled" and not kernels.numba_available():
        pytest.skip("Numba is not installed")
    return request.param


def libcachesim_misses(data: ReplayInput, policy: str, cache_size: int, tmp_path) -> int:
    path = tmp_path / "trace.oracleGeneral.bin"
    if not path.exists():
        write_oracle_general(data.sequence, path, expert_bytes=None)  # size 1: capacity counts experts
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _ = getattr(lcs, LIBCACHESIM[policy])(cache_size).process_trace(reader)
    return round(miss_ratio * len(data.sequence))


def assert_agreement(data: ReplayInput, cache_sizes, tmp_path, engine):
    for size in cache_sizes:
        for policy in LIBCACHESIM:
            if engine == "compiled" and POLICIES[policy].policy.replay_kernel is None:
                continue  # no compiled form: the python engine's run checks it
            ours = replay(data, policy, size, engine=engine).misses
            assert ours == libcachesim_misses(data, policy, size, tmp_path), (policy, size)


@pytest.mark.parametrize("a,top_k", [(0.8, 1), (1.2, 2), (2.0, 4)])
def test_zipf_traces(a, top_k, tmp_path, engine):
    trace = zipf_trace(num_layers=8, num_experts=16, top_k=top_k, length=1500, a=a, b=1.0, seed=11, shuffle=True)
    assert_agreement(ReplayInput.of(trace), (top_k * 4, 16, 37, 64, 100), tmp_path, engine)


def test_bundled_olmoe_trace(tmp_path, engine):
    data = ReplayInput.of(read_trace(DEFAULT_TRACE))
    assert_agreement(data, (8, 64, 200, 256, 511, 800), tmp_path, engine)


def test_qwen_traces(qwen_folder, tmp_path, engine):
    trace = import_routes_json([qwen_folder / f"{name}.json" for name in QWEN_FILES], num_experts=60)
    assert_agreement(ReplayInput.of(trace), (4, 96, 360, 720), tmp_path, engine)
