"""Fixtures shared by the test files: the real traces recorded by others, in ../shared/traces, and a private
pack cache so that no test writes into the user's ~/.cache.

Where ../shared/traces is absent (a fresh clone), the OLMoE file is rebuilt from the trace the package ships
(``olmoe-1b-7b-decode299.parquet`` is the lossless import of it: same ids in the same order, same positions),
so the tests of the ``topk-jsonl`` importer still run. The Qwen routes files have no shipped counterpart;
their tests skip and say so (``pytest -rs`` lists the reasons)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

QWEN_FILES = ("cooking_1", "history_1", "history_2", "ml_moe_1", "ml_moe_2", "ml_moe_3")

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture(scope="session", autouse=True)
def private_pack_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path_factory.mktemp("pack-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"the shared real traces are not available at {SHARED_TRACES}")
    return SHARED_TRACES


def write_olmoe_jsonl(path: Path) -> Path:
    """Write the bundled OLMoE trace back in its source format: one ``{"tok": n, "layers": [[8 ids] x 16]}``
    line per decode step, in step order."""
    from moe_offload.bundled import DEFAULT_TRACE
    from moe_offload.trace import read_trace

    trace = read_trace(DEFAULT_TRACE)
    lines = (json.dumps({"tok": int(position), "layers": experts.tolist()})
             for position, experts in zip(trace.position, trace.experts))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def olmoe_file(tmp_path_factory) -> Path:
    """``decode_299.jsonl`` from ../shared/traces, or rebuilt from the shipped trace where that is absent."""
    shared = SHARED_TRACES / "olmoe-1b-7b" / "decode_299.jsonl"
    if shared.is_file():
        return shared
    return write_olmoe_jsonl(tmp_path_factory.mktemp("olmoe") / "decode_299.jsonl")


@pytest.fixture(scope="session")
def qwen_folder() -> Path:
    folder = SHARED_TRACES / "qwen1.5-moe-a2.7b"
    if not folder.is_dir():
        pytest.skip(f"the Qwen routes files are not shipped with the package and not available at {folder}")
    return folder


@pytest.fixture(scope="session")
def tiny_trace():
    """The bundled recording of the tiny Mixtral (every column), read once."""
    from moe_offload.bundled import DEFAULT_TINY_TRACE
    from moe_offload.trace import read_trace

    return read_trace(DEFAULT_TINY_TRACE)


@pytest.fixture(scope="session")
def tiny_server():
    """The bundled tiny model served on loopback (tests/tiny_server.py), one for the whole session: tests that
    read /metrics compare counts before and after their own requests."""
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from tiny_server import serving

    with serving() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_recorded():
    """What `record` sees for tests/tiny_server.py's PROMPTS, one prompt at a time."""
    pytest.importorskip("torch")
    from tiny_server import recorded_alone

    return recorded_alone()


@pytest.fixture
def uncompiled_policy(monkeypatch):
    """The name of a registered policy with no compiled kernel, as a new policy starts before its kernel is
    written (every policy the project ships has one): LRU's hooks under the name "lru-objects"."""
    from moe_offload.policies import POLICIES, PolicyInfo
    from moe_offload.policies.lru import LRU

    class ObjectsOnly(LRU):
        name = "lru-objects"
        replay_kernel = None

    monkeypatch.setitem(POLICIES, ObjectsOnly.name, PolicyInfo(ObjectsOnly.name, ObjectsOnly))
    return ObjectsOnly.name
