"""Fixtures shared by the test files: the real traces recorded by others, in ../shared/traces, and a private
pack cache so that no test writes into the user's ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest

QWEN_FILES = ("cooking_1", "history_1", "history_2", "ml_moe_1", "ml_moe_2", "ml_moe_3")


@pytest.fixture(scope="session", autouse=True)
def private_pack_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path_factory.mktemp("pack-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    folder = Path(__file__).resolve().parents[2] / "shared" / "traces"
    if not folder.is_dir():
        pytest.skip(f"the shared real traces are not available at {folder}")
    return folder


@pytest.fixture(scope="session")
def olmoe_file(shared_traces) -> Path:
    return shared_traces / "olmoe-1b-7b" / "decode_299.jsonl"


@pytest.fixture(scope="session")
def qwen_folder(shared_traces) -> Path:
    return shared_traces / "qwen1.5-moe-a2.7b"


@pytest.fixture(scope="session")
def tiny_trace():
    """The bundled recording of the tiny Mixtral (every column), read once."""
    from moe_offload.bundled import DEFAULT_TINY_TRACE
    from moe_offload.trace import read_trace

    return read_trace(DEFAULT_TINY_TRACE)
