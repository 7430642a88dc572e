"""`moe-offload placement` prints the best setting's command line or writes its file; bad input is one line, exit 2;
and every command `report tiny` prints under "what to run" runs as printed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_offload.cli.main import main
from moe_offload.simulator.timed.schedule import leading_iterations
from moe_offload.trace.format import PREFILL, Trace, TraceMeta

SRC = Path(__file__).resolve().parents[1] / "src"


def run_cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def test_placement_prints_flags_and_writes_the_neutral_json(tmp_path):
    output = tmp_path / "olmoe-llama.json"
    code, out, err = run_cli(["placement", "olmoe", "--engine", "llama.cpp", "--fast-memory", "50%",
                              "--timed-tokens", "16", "-o", str(output)])
    assert code == 0, err
    command = out.splitlines()[1]
    assert command.startswith("llama-server -m MODEL.gguf --n-gpu-layers 999 ")
    document = json.loads(output.read_text())
    assert document["command"] == command and len(document["resident_experts_per_layer"]) == 16
    # llama.cpp keeps whole layers in VRAM from the start (with or without PR #27861's cache of the others)
    kept = [len(layer) for layer in document["resident_experts_per_layer"]]
    assert set(kept) <= {0, 64} and sum(kept) <= 512


def test_where_every_expert_fits_vllm_needs_no_flag(tmp_path):
    output = tmp_path / "vllm.json"
    code, out, err = run_cli(["placement", "tiny", "--engine", "vllm", "--fast-memory", "100%", "--timed-tokens", "16",
                              "-o", str(output)])
    assert code == 0, err
    assert out.splitlines()[0].startswith("# vllm at 64 experts: every expert in VRAM (no offload flag), the least")
    assert out.splitlines()[1] == "vllm serve moe-offload/tiny-mixtral"
    document = json.loads(output.read_text())
    assert document["flags"] == [] and [len(layer) for layer in document["resident_experts_per_layer"]] == [8] * 8


def test_on_the_edge_box_the_pr_cache_is_listed_with_why_it_is_not_timed():
    # FlashMoE's edge box keeps 1 GiB of host memory for experts, and OLMoE's are 12 GiB: PR #27861 uploads
    # from host memory, so its settings are listed, not timed, and the best is one the box can run
    code, out, err = run_cli(["placement", "olmoe", "--engine", "llama.cpp", "--fast-memory", "25%",
                              "--hardware", "edge-flashmoe", "--timed-tokens", "16"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("# llama.cpp at 256 experts: ") and "the least TPOT of 3 settings timed" in lines[0]
    untimed = lines[1:-1]
    assert len(untimed) == 3 and all("(PR #27861): not timed: PR #27861 uploads experts from host memory, and the "
                                     "1,024 experts (12 GiB) do not fit edge-flashmoe's host tier (1 GiB)" in line
                                     for line in untimed)
    assert lines[-1].startswith("llama-server -m MODEL.gguf --n-gpu-layers 999 ")
    assert "--moe-expert-cache" not in lines[-1]


def test_placement_writes_ktransformers_counts(tmp_path):
    torch = pytest.importorskip("torch")
    output = tmp_path / "kt.pt"
    code, out, err = run_cli(["placement", "tiny", "--engine", "ktransformers", "--fast-memory", "25%",
                              "--timed-tokens", "32", "-o", str(output)])
    assert code == 0, err
    assert "--kt-expert-placement-strategy frequency --init-expert-location kt-expert-frequency.pt" in out
    counts = torch.load(output, weights_only=True)["logical_count"]
    assert tuple(counts.shape) == (1, 8, 8) and int(counts.sum()) > 0


@pytest.mark.parametrize("argv, problem", [
    (["--engine", "all"], "name one of"),
    (["--engine", "tgi"], "--engine 'tgi'"),
    (["--engine", "vllm", "-o", "out.txt"], "out.txt"),
    (["--engine", "llama.cpp", "-o", "out.pt"], "out.pt: no llama.cpp setting reads a file; write FILE.json"),
    (["--engine", "vllm", "--profile", "missing.parquet"], "missing.parquet"),
])
def test_bad_placement_input_is_one_line(tmp_path, argv, problem):
    argv = [a if a not in ("out.txt", "out.pt") else str(tmp_path / a) for a in argv]
    code, out, err = run_cli(["placement", "tiny", "--fast-memory", "25%", *argv])
    assert code == 2 and problem in err and len(err.strip().splitlines()) == 1 and out == ""


def test_a_long_prompt_is_followed_by_decoding_in_the_timed_sample():
    """A prompt of 200 tokens and 10 decode steps, sampled at 129 rows: the sample decodes (TPOT defined)."""
    experts = np.zeros((210, 1, 1), np.int64)
    meta = TraceMeta(model="m", num_layers=1, num_experts=2, top_k=1)
    trace = Trace.build(meta, experts, request=np.zeros(210), position=np.arange(210),
                        iteration=np.r_[np.zeros(200), np.arange(1, 11)],
                        phase=np.r_[np.full(200, PREFILL), np.ones(10)])
    sample = leading_iterations(trace, 129)
    assert sample.num_tokens == 201 and (sample.phase != PREFILL).sum() == 1


def test_every_command_under_what_to_run_runs_as_printed(tmp_path):
    code, out, err = run_cli(["report", "tiny", "--fast-memory", "25%", "--timed-tokens", "32", "--jobs", "1",
                              "--engine", "vllm"])
    assert code == 0, err
    lines = out.splitlines()
    commands = [line.strip() for line in lines[lines.index("what to run:") + 1:] if line.startswith("  moe-offload")]
    assert commands
    environment = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    moe_offload = [sys.executable, "-m", "moe_offload.cli.main"]
    for command in commands:
        argv = shlex.split(command.replace(" > split.json", ""))
        with open(tmp_path / "split.json", "w") if command.endswith("> split.json") else open(os.devnull, "w") as sink:
            done = subprocess.run(moe_offload + argv[1:], cwd=tmp_path, env=environment, stdout=sink,
                                  stderr=subprocess.PIPE, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stderr}"


@pytest.mark.parametrize("argv, problem", [
    (["--engine", "tgi"], "--engine 'tgi': choose one of llama.cpp"),
    (["--profile", "olmoe"], "--profile olmoe: a trace of 16 layers x 64 experts cannot profile a model of 8 x 8"),
])
def test_bad_engine_options_of_report_are_refused_before_any_work(argv, problem):
    code, out, err = run_cli(["report", "tiny", "--fast-memory", "25%", *argv])
    assert code == 2 and problem in err and out == ""


def test_an_engine_with_no_timed_setting_says_why_in_one_line():
    # 8 experts of fast memory are not one a layer of OLMoE's 16, so vLLM's only setting is its UVA offload,
    # which reads from pinned host memory: the edge box's 1 GiB cannot hold the 12 GiB of experts
    code, out, err = run_cli(["placement", "olmoe", "--engine", "vllm", "--fast-memory", "8", "--hardware",
                              "edge-flashmoe", "--timed-tokens", "16"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert ("vllm: its one setting at 8 experts is not timed (UVA reads the offloaded experts from pinned host "
            "memory, and the 1,024 experts (12 GiB) do not fit edge-flashmoe's host tier (1 GiB))") in err
    # all four of vLLM's settings read pinned host memory: each says why
    code, out, err = run_cli(["placement", "olmoe", "--engine", "vllm", "--fast-memory", "25%", "--hardware",
                              "edge-flashmoe", "--timed-tokens", "16"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert ("vllm: none of its 4 settings at 256 experts is timed; --cpu-offload-gb 9.0 (the first 12 layers' "
            "experts): not timed: UVA reads") in err
    assert ("; --offload-group-size 6 --offload-num-in-group 5 --offload-prefetch-step 1 (13 layers streamed, 1 "
            "ahead): not timed: the offloaded layers' experts are copied from pinned host memory") in err
    assert "; --moe-expert-cache-size 16 (PR #37190): not timed: PR #37190 copies its misses from pinned" in err
    # every KTransformers setting needs all experts in host memory: the reason once, not once a setting
    code, out, err = run_cli(["placement", "olmoe", "--engine", "ktransformers", "--fast-memory", "25%",
                              "--hardware", "edge-flashmoe", "--timed-tokens", "16"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.count("issue #2084") == 1
    assert "ktransformers: none of its 4 settings at 256 experts is timed (kt-kernel loads every expert" in err


def test_the_engines_that_read_a_file_are_those_whose_settings_export_one(tiny_trace):
    from moe_offload.engines import ENGINES, PlacementContext
    from moe_offload.hardware import resolve_profile
    from moe_offload.policies import ModelSpec

    meta = tiny_trace.meta
    context = PlacementContext(ModelSpec(meta.num_layers, meta.num_experts, meta.top_k), 16, tiny_trace,
                               resolve_profile("desktop-rtx4090"), meta.expert_bytes)
    exports = {name: any(s.export is not None for s in engine.settings(context)) for name, engine in ENGINES.items()}
    assert exports == {name: engine.reads_files for name, engine in ENGINES.items()}
    assert exports == {"llama.cpp": False, "ktransformers": True, "vllm": False, "sglang": True}
