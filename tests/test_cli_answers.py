"""Commands answer every request: a run that cannot be made is an error or a note in every output mode,
never silence; everything checkable is checked before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_offload.trace.format import TraceMeta, write_trace
from moe_offload.trace.synthetic import zipf_trace
from cli_driver import assert_refused, run  # noqa: E402


@pytest.fixture
def layers32(tmp_path) -> Path:
    """32 layers x 8 experts, top-2: a cache of 16 experts is below one per layer for the -dist policies."""
    trace = zipf_trace(num_layers=32, num_experts=8, top_k=2, length=20, a=1.0, b=1.0, seed=1)
    trace.meta = TraceMeta(model="z", num_layers=32, num_experts=8, top_k=2, expert_bytes=4096)
    return write_trace(trace, tmp_path / "layers32.parquet")


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_a_size_no_policy_can_run_at_is_an_error(capsys, layers32, mode):
    code, out, err = run(capsys, "simulate", layers32, "--policy", "lru-dist", "--cache-size", "16", *mode)
    assert_refused(code, err, "--cache-size 16", "nothing can run", "32 layers", "holds 16")
    assert out == ""


def test_a_skipped_size_is_noted_in_the_table(capsys, layers32):
    code, out, err = run(capsys, "simulate", layers32, "--policy", "lru-dist", "--cache-size", "16,64")
    assert code == 0
    assert "cache of 64 experts" in out and "cache of 16 experts" not in out
    assert "skipped: lru-dist at 16" in " ".join(out.split())


def test_a_skipped_size_is_noted_beside_the_json(capsys, layers32):
    code, out, err = run(capsys, "simulate", layers32, "--policy", "lru-dist", "--cache-size", "16,64", "--json")
    assert code == 0
    rows = json.loads(out)  # stdout stays one JSON document
    assert [(r["policy"], r["cache_size"]) for r in rows] == [("lru-dist", 64)]
    assert err.startswith("skipped: lru-dist at 16: lru-dist splits the cache among 32 layers")


# ------------------------------------------------------------------------------ one prefetcher vocabulary

def test_generate_accepts_none_as_simulate_does(capsys, monkeypatch):
    """'none' is the documented default of simulate --timed; generate takes the same word (no prefetcher)."""
    pytest.importorskip("torch")
    seen = {}

    def fake_engine(plan, **_):  # the word reaches the engine's plan as "no prefetcher", nothing else changes
        seen["plan"] = plan
        raise SystemExit(0)

    monkeypatch.setattr("moe_offload.runtime.engine.OffloadEngine", fake_engine)
    code, _, err = run(capsys, "generate", "hi", "--prefetch", "none", "--device", "cpu")
    assert code == 0, err
    assert seen["plan"].prefetch is None and seen["plan"].describe()["prefetch"] is None


# ------------------------------------------------------------------- checked before anything is loaded

def model_loads_forbidden(monkeypatch):
    import importlib.util

    def fail(*_, **__):
        raise AssertionError("the model was loaded before the arguments were checked")

    if importlib.util.find_spec("torch") is not None:  # without it nothing can load
        monkeypatch.setattr("moe_offload.runtime.engine.OffloadEngine", fail)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_learning_prefetcher_without_history_is_refused_first(capsys, monkeypatch, tmp_path, command):
    model_loads_forbidden(monkeypatch)
    argv = [command, *(["hi"] if command == "generate" else []), "--model", tmp_path, "--prefetch", "moe-infinity"]
    code, _, err = run(capsys, *argv)
    assert_refused(code, err, "--prefetch moe-infinity predicts from past sequences", "--prefetch-history TRACE")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_prefetcher_reading_the_future_is_refused_first(capsys, monkeypatch, command):
    model_loads_forbidden(monkeypatch)
    code, _, err = run(capsys, command, *(["hi"] if command == "generate" else []), "--prefetch", "oracle")
    assert_refused(code, err, "--prefetch oracle reads the future routing")


def test_a_missing_history_file_is_refused_first(capsys, monkeypatch, tmp_path):
    model_loads_forbidden(monkeypatch)
    code, _, err = run(capsys, "generate", "hi", "--prefetch", "moe-infinity",
                       "--prefetch-history", tmp_path / "absent.parquet")
    assert_refused(code, err, "absent.parquet")


def test_simulate_timed_refuses_a_learning_prefetcher_without_history(capsys, layers32):
    code, _, err = run(capsys, "simulate", layers32, "--timed", "--prefetch", "moe-infinity")
    assert_refused(code, err, "--prefetch moe-infinity predicts from past sequences", "--history TRACE")


def test_serve_refuses_a_busy_port_before_loading(capsys, monkeypatch):
    import socket

    pytest.importorskip("fastapi")
    model_loads_forbidden(monkeypatch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run(capsys, "serve", "--port", port)
    assert_refused(code, err, f"cannot listen on 127.0.0.1:{port}")


# ----------------------------------------------------------- configure's budget is the budget generate runs

@pytest.mark.parametrize("budget", ["50%", "10%"])  # 10%: the ratios' rounding to whole rows would go over
def test_what_configure_writes_for_a_budget_runs_at_that_budget(capsys, tmp_path, budget):
    pytest.importorskip("torch")
    timings = ["--expert-load-ms", "0.6", "--expert-compute-ms", "0.1", "--attention-ms", "0.3"]
    code, out, err = run(capsys, "configure", "tiny", "--vram-budget", budget, *timings, "--json")
    assert code == 0, err
    document = json.loads(out)
    # 64 experts of the tiny model; the buffer of top-k = 2 experts comes out of the budget
    total = 64 * float(budget.rstrip("%")) / 100
    assert document["vram_budget_experts"] == pytest.approx(total)
    assert document["budget_experts"] == pytest.approx(total - 2) and document["buffer_experts"] == 2
    config = tmp_path / "split.json"
    config.write_text(out)
    code, out, err = run(capsys, "generate", "def", "--fast-budget", budget, "--split-config", config,
                         "--max-new-tokens", "2", "--device", "cpu")
    assert code == 0, err


def test_configure_refuses_a_budget_that_is_all_buffer(capsys):
    code, _, err = run(capsys, "configure", "tiny", "--vram-budget", "2", "--expert-load-ms", "0.6",
                       "--expert-compute-ms", "0.1", "--attention-ms", "0.3")
    assert_refused(code, err, "--vram-budget '2'", "prefetch buffer of top-k = 2 experts")


# ------------------------------------------------------------- a base install names every extra to install

def without_modules(monkeypatch, *modules):
    """As in an install without them: importing any of ``modules`` raises ImportError."""
    import sys

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_hardware_measure_without_the_models_extra(capsys, monkeypatch, tmp_path):
    without_modules(monkeypatch, "torch", "transformers")
    code, _, err = run(capsys, "hardware", "measure", "-o", tmp_path / "m.toml")
    assert_refused(code, err, "hardware measure needs torch, transformers, which are not installed",
                   "pip install 'moe-offload[models]'")


def test_serve_names_both_extras_at_once(capsys, monkeypatch):
    without_modules(monkeypatch, "torch", "fastapi")
    code, _, err = run(capsys, "serve")
    assert_refused(code, err, "serve needs torch, fastapi", "pip install 'moe-offload[models,serve]'")


def test_serve_names_only_what_is_missing(capsys, monkeypatch):
    pytest.importorskip("torch")
    without_modules(monkeypatch, "uvicorn")
    code, _, err = run(capsys, "serve")
    assert_refused(code, err, "serve needs uvicorn, which is not installed: pip install 'moe-offload[serve]'")


def test_generate_with_the_tiny_model_says_what_it_is_for(capsys):
    pytest.importorskip("torch")
    code, out, err = run(capsys, "generate", "hi", "--max-new-tokens", "2", "--device", "cpu")
    assert code == 0, err
    text = " ".join(out.split())
    assert "note: the bundled tiny model (8 layers x 8 experts, top-2, trained for minutes on a CPU)" in text
    assert "its text is not meant to make sense" in text


# ------------------------------------------------------------------------------ one unit family per table

def test_binary_units():
    from moe_offload.reporting.tables import binary_bytes

    assert [binary_bytes(n) for n in (512, 98_304, 1.5 * 2**30, 2e12)] == ["512 B", "96 KiB", "1.5 GiB", "1.82 TiB"]


def test_the_preset_table_has_rates_and_sizes_in_binary_units():
    from moe_offload.cli.hardware_cmd import _link_summary
    from moe_offload.hardware import resolve_profile

    # the desktop preset's links: 25 GB/s = 23.3 GiB/s and 7 GB/s = 6.52 GiB/s
    assert _link_summary(resolve_profile("desktop-rtx4090")) == "host->gpu 23.3 GiB/s, ssd->host 6.52 GiB/s"
