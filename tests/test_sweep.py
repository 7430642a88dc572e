"""`moe-offload sweep`: a cell's row is what `simulate` computes for it; processes and a local Ray give the rows of
--jobs 1; a resumed or interrupted sweep runs only the missing cells; every bad sweep file fails in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from moe_offload.cli.main import main
from moe_offload.hardware import resolve_profile
from moe_offload.simulator.grid import replay_grid
from moe_offload.simulator.replay import ReplayInput
from moe_offload.simulator.timed import Arrivals, timed_grid
from moe_offload.sweep import run as sweep_run
from moe_offload.sweep.store import read_results, to_table
from moe_offload.trace.format import Trace, write_trace
from moe_offload.trace.synthetic import zipf_trace

EXPERT_BYTES = 2**20
SWEEP = """
traces = ["zipf.parquet"]
policies = ["lcp", "random", "lru-dist"]
cache_sizes = [3, 0.75]
seeds = [0, 1]
modes = ["replay", "timed"]
output = "results.parquet"

[policy_options.lcp]
rho = 0.5

[timed]
hardware = ["desktop-rtx4090"]
prefetchers = ["none", "topk"]
expert_bytes = "1MiB"
arrivals = "poisson:200"
max_batch = 2
"""


def zipf() -> Trace:
    """Zipf routing for three requests of 15, 15 and 10 tokens (which Poisson arrivals batch)."""
    tokens = zipf_trace(num_layers=4, num_experts=6, top_k=2, length=40, a=1.0, b=1.0, seed=4, shuffle=True)
    request = np.repeat([0, 1, 2], [15, 15, 10])
    position = np.concatenate([np.arange(15), np.arange(15), np.arange(10)])
    return Trace.build(tokens.meta, tokens.experts, request=request, position=position)


@pytest.fixture
def sweep_file(tmp_path) -> Path:
    write_trace(zipf(), tmp_path / "zipf.parquet")
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    return path


def table(path):
    return pq.read_table(path)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The whole sweep in this process (--jobs 1): the rows every other way of running it must give."""
    folder = tmp_path_factory.mktemp("full-run")
    write_trace(zipf(), folder / "zipf.parquet")
    (folder / "sweep.toml").write_text(SWEEP)
    assert main(["sweep", str(folder / "sweep.toml"), "--jobs", "1"]) == 0
    return folder / "results.parquet"


def test_rows_are_what_simulate_computes(full_run):
    rows = read_results(full_run)
    trace = zipf()
    data = ReplayInput.of(trace, name="zipf.parquet")
    policies = ["lcp", "random", "lru-dist"]
    sizes = [3, 18]  # 3 and 0.75 of 24 experts
    options = {"lcp": {"rho": 0.5}}
    hardware = resolve_profile("desktop-rtx4090")
    for seed in (0, 1):
        expected = {(r.policy, r.cache_size): r.to_dict()
                    for r in replay_grid(data, policies + ["belady"], sizes, seed=seed, options=options).results}
        got = {(row.result.policy, row.result.cache_size): row.result.to_dict() for row in rows
               if row.cell.mode == "replay" and row.cell.seed in (seed, None)}  # None: the same at every seed
        assert got == expected  # lru-dist at 3 experts for 4 layers is skipped by both
        arrivals = Arrivals.parse("poisson:200", 2, seed)
        expected = {}
        for policy in policies:
            for result in timed_grid(trace, hardware, [policy], [None, "topk"],
                                     [s * EXPERT_BYTES for s in sizes if policy != "lru-dist" or s >= 4],
                                     expert_bytes=EXPERT_BYTES, arrivals=arrivals, seed=seed, policy_options=options,
                                     name="zipf.parquet"):
                expected[(result.policy, result.prefetcher, result.cache_bytes)] = result.to_dict()
        got = {(row.result.policy, row.result.prefetcher, row.result.cache_bytes): row.result.to_dict()
               for row in rows if row.cell.mode == "timed" and row.cell.seed == seed}
        assert got == expected
    lcp = next(row for row in rows if row.cell.policy == "lcp" and row.cell.mode == "timed")
    assert json.loads(lcp.cell.options) == {"arrivals": "poisson:200", "max_batch": 2, "history": None,
                                            "expert_bytes": EXPERT_BYTES, "policy": {"rho": 0.5}}
    assert set(table(full_run).column_names) >= {
        "cell", "mode", "seed", "options", "trace", "policy", "cache_size", "prefetcher", "hardware", "misses",
        "opt_misses", "tpot_seconds", "timeline", "token_latency_seconds"}
    random = [row.result.tpot_seconds for row in rows if row.cell.policy == "random" and row.cell.mode == "timed"
              and row.cell.prefetcher is None and row.cell.cache_size == 18 * EXPERT_BYTES]
    assert len(random) == 2 and random[0] != random[1]  # the seed is a dimension of the sweep


def test_deterministic_policies_are_replayed_once_not_per_seed(full_run):
    replayed = [row.cell for row in read_results(full_run) if row.cell.mode == "replay"]
    # belady, lcp at 3 and 18 experts and lru-dist at 18 once; random at both sizes for seeds 0 and 1
    assert sorted((c.policy, c.cache_size, c.seed) for c in replayed if c.seed is None) == [
        ("belady", 3, None), ("belady", 18, None), ("lcp", 3, None), ("lcp", 18, None), ("lru-dist", 18, None)]
    assert sorted((c.policy, c.cache_size, c.seed) for c in replayed if c.seed is not None) == [
        ("random", 3, 0), ("random", 3, 1), ("random", 18, 0), ("random", 18, 1)]


def test_only_the_seeded_policies_depend_on_the_seed():
    """The flag that lets a sweep run a policy once is what the policies do: two seeds, the same misses, for
    every policy but those marked seeded (a second reading: the replays themselves)."""
    from moe_offload.policies import POLICIES, default_policies

    data = ReplayInput.of(zipf(), name="zipf")
    for name in default_policies():
        info = POLICIES[name]
        runs = [replay_grid(data, [name], [12], seed=seed).results for seed in (0, 1, 2)]
        misses = {tuple(r.misses for r in results if r.policy == name) for results in runs}
        assert (len(misses) > 1) == info.policy.seeded, name


def test_processes_give_the_rows_of_one_job(full_run, sweep_file):
    assert main(["sweep", str(sweep_file), "--jobs", "2", "-o", str(sweep_file.parent / "two.parquet")]) == 0
    assert table(sweep_file.parent / "two.parquet").equals(table(full_run))


def test_a_local_ray_gives_the_rows_of_one_job(full_run, sweep_file):
    pytest.importorskip("ray")
    assert main(["sweep", str(sweep_file), "--ray", "--jobs", "2", "-o", str(sweep_file.parent / "ray.parquet")]) == 0
    assert table(sweep_file.parent / "ray.parquet").equals(table(full_run))


RUN_CELL = sweep_run.run_cell


def counting_cells(monkeypatch, stop_after=None):
    """Record the cells run from now on (in this process: --jobs 1); raise KeyboardInterrupt after ``stop_after``."""
    ran = []
    original = RUN_CELL

    def run_cell(workload, cell):
        if stop_after is not None and len(ran) == stop_after:
            raise KeyboardInterrupt
        ran.append(cell)
        return original(workload, cell)

    monkeypatch.setattr(sweep_run, "run_cell", run_cell)
    return ran


def test_a_resumed_sweep_runs_only_the_missing_cells(full_run, sweep_file, monkeypatch):
    output = sweep_file.parent / "results.parquet"
    rows = read_results(full_run)
    pq.write_table(to_table(rows[:5] + rows[9:]), output)  # as if the sweep had stopped before 4 of its cells
    ran = counting_cells(monkeypatch)
    assert main(["sweep", str(sweep_file), "--jobs", "1"]) == 0
    assert [cell.key for cell in ran] == [row.cell.key for row in rows[5:9]]
    assert table(output).equals(table(full_run))
    assert main(["sweep", str(sweep_file), "--jobs", "1"]) == 0  # nothing left to run
    assert len(ran) == 4


def test_an_interrupted_sweep_keeps_its_finished_cells_and_resumes(full_run, sweep_file, monkeypatch, capsys):
    output = sweep_file.parent / "results.parquet"
    cells = table(full_run).num_rows
    ran = counting_cells(monkeypatch, stop_after=6)
    assert main(["sweep", str(sweep_file), "--jobs", "1"]) == 130
    assert [row.cell.key for row in read_results(output)] == [cell.key for cell in ran]
    assert (f"interrupted: 6 of {cells} cells saved in {output}; the same command runs the other {cells - 6}"
            in capsys.readouterr().err)
    ran = counting_cells(monkeypatch)
    assert main(["sweep", str(sweep_file), "--jobs", "1"]) == 0
    assert f"{cells} cells, 6 already in {output}, {cells - 6} to run" in capsys.readouterr().err
    assert len(ran) == cells - 6
    assert table(output).equals(table(full_run))


def test_the_sweep_prints_simulates_tables_and_plots(sweep_file, capsys):
    figure = sweep_file.parent / "misses.png"
    assert main(["sweep", str(sweep_file), "--jobs", "1", "--plot", str(figure), "--plot-cdf",
                 str(sweep_file.parent / "cdf.png")]) == 0
    out = capsys.readouterr().out
    assert "zipf.parquet  -  cache of 18 experts" in out and "misses / OPT" in out  # the replay's tables
    assert "TPOT / all-resident" in out and "expert traffic" in out              # the timed tables
    assert "seed 1" in out and "skipped: replay zipf.parquet, lru-dist at 3 experts" in out
    assert figure.read_bytes()[:4] == b"\x89PNG"


BIG_SWEEP = """
traces = ["zipf.parquet"]
policies = "all"
cache_sizes = [4, 8, 12, 16, 20]
seeds = [0, 1]
output = "big.parquet"
"""


def test_a_large_sweep_prints_a_summary_and_the_tables_on_request(sweep_file, capsys):
    from moe_offload.cli.sweep_cmd import FULL_TABLES_UP_TO
    from moe_offload.policies import default_policies

    big = sweep_file.parent / "big.toml"
    big.write_text(BIG_SWEEP)
    assert main(["sweep", str(big), "--jobs", "1"]) == 0
    cells = read_results(sweep_file.parent / "big.parquet")
    assert len(cells) > FULL_TABLES_UP_TO
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "seed 0" and lines[2] == "seed 1" and len(lines) == 4  # one line per trace and seed
    lines = lines[1::2]
    assert all(line.startswith("zipf.parquet: ") for line in lines)
    assert f"{len(default_policies())} policies at 5 cache sizes; best online policy  k=4: " in lines[0]
    assert f"a summary of {len(cells)} cells: --tables prints every table" in captured.err
    assert main(["sweep", str(big), "--jobs", "1", "--tables"]) == 0  # nothing left to run: the tables only
    out = capsys.readouterr().out
    assert out.count("misses / OPT") == 2 * 5 and "seed 1" in out


BAD = [
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\ncolour = 1\n",
     "sweep.toml: colour: unknown key"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\n", "sweep.toml: cache_sizes: missing"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"nope\"]\ncache_sizes = [4]\n",
     "sweep.toml: policies: unknown policy 'nope'"),
    ("traces = [\"missing.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\n",
     "sweep.toml: traces: {tmp}/missing.parquet: no such file"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [\"lots\"]\n",
     "sweep.toml: cache_sizes: 'lots' is neither a number of experts"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [1]\n",
     "sweep.toml: cache_sizes: a cache of 1 experts is smaller than top-k = 2"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [1.5]\n",
     "sweep.toml: cache_sizes: 1.5 is neither a number of experts"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [\"200%\"]\n",
     "sweep.toml: cache_sizes: '200%' is neither a number of experts, a percentage in (0, 100]"),
    ("traces = [\"zipf.parquet\"]\npolicies = \"lru\"\ncache_sizes = [4]\n",
     "sweep.toml: policies: must be \"all\" or a non-empty list of names"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lcp\"]\ncache_sizes = [4]\n[policy_options.lcp]\nrho = 2.0\n",
     "sweep.toml: policy_options.lcp: lcp.rho 2.0: must be a number in (0, 1)"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lcp\"]\ncache_sizes = [4]\n[policy_options.lcp]\nsigma = 2\n",
     "sweep.toml: policy_options.lcp: lcp:"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\nengine = \"turbo\"\n",
     "sweep.toml: engine: 'turbo' is not one of auto, compiled, python"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\n[timed]\nprefetchers = [\"topk\"]\n",
     "sweep.toml: timed: applies only when modes includes \"timed\""),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\nmodes = [\"timed\"]\n[timed]\n"
     "expert_bytes = 1024\nprefetchers = [\"psychic\"]\n", "sweep.toml: timed.prefetchers: unknown prefetcher 'psychic'"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\nmodes = [\"timed\"]\n[timed]\n"
     "expert_bytes = 1024\nhardware = [\"cray-1\"]\n", "sweep.toml: timed.hardware: unknown hardware preset 'cray-1'"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\nmodes = [\"timed\"]\n[timed]\n"
     "expert_bytes = 1024\nspeed = 3\n", "sweep.toml: timed.speed: unknown key"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\nmodes = [\"timed\"]\n",
     "sweep.toml: timed.expert_bytes: trace zipf.parquet gives no expert size"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [4]\nmodes = [\"timed\"]\n[timed]\n"
     "expert_bytes = 1024\nprefetchers = [\"moepic\"]\n", "sweep.toml: timed.prefetchers: prefetcher 'moepic' needs"),
    ("traces = [\"zipf.parquet\"]\npolicies = [\"lru\"]\ncache_sizes = [\"64GiB\"]\nmodes = [\"timed\"]\n[timed]\n"
     "expert_bytes = 1024\n", "does not fit in the"),
    ("traces = [\"zipf.parquet\"\n", "sweep.toml: not a valid TOML sweep file"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_bad_sweep_file_fails_in_one_line_before_any_work(tmp_path, capsys, text, message):
    write_trace(zipf(), tmp_path / "zipf.parquet")
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err and err.count("\n") == 1 and "Traceback" not in err
    assert str(path) in err and not (tmp_path / "sweep.parquet").exists()


def test_an_output_that_is_not_a_sweeps_results_is_left_alone(sweep_file, capsys):
    other = sweep_file.parent / "zipf.parquet"  # a trace: Parquet, not a sweep's results
    before = other.read_bytes()
    assert main(["sweep", str(sweep_file), "-o", str(other)]) == 2
    assert "is also an input of this command" in capsys.readouterr().err
    stranger = sweep_file.parent / "stranger.parquet"
    stranger.write_bytes(before)
    assert main(["sweep", str(sweep_file), "-o", str(stranger)]) == 2
    assert "exists and is not a moe-offload sweep results file" in capsys.readouterr().err
    assert stranger.read_bytes() == before == other.read_bytes()


def test_an_output_in_a_folder_not_yet_made_is_written_there(full_run, sweep_file):
    output = sweep_file.parent / "results" / "sweep.parquet"  # as the sweep-file page's `output` shows
    assert main(["sweep", str(sweep_file), "--jobs", "1", "-o", str(output)]) == 0
    assert table(output).column("cell").to_pylist() == table(full_run).column("cell").to_pylist()


def test_without_ray_the_command_says_how_to_get_it(sweep_file, capsys, monkeypatch):
    monkeypatch.setattr(sweep_run, "ray_available", lambda: False)
    assert main(["sweep", str(sweep_file), "--ray"]) == 2
    assert "--ray needs Ray: pip install 'moe-offload[ray]'" in capsys.readouterr().err


def test_the_timed_summary_names_the_lowest_tpot_at_each_cache_size(full_run):
    import io

    from rich.console import Console

    from moe_offload.reporting.tables import print_timed_summary, run_label

    results = [row.result for row in read_results(full_run) if row.cell.mode == "timed" and row.cell.seed == 0]
    out = io.StringIO()
    print_timed_summary(results, Console(file=out, width=1000), hardware=resolve_profile("desktop-rtx4090"))
    line = out.getvalue().strip()
    assert line.startswith(f"zipf.parquet on desktop-rtx4090: {len(results)} runs; lowest TPOT  3 MiB: ")
    bound = next(r for r in results if r.policy == "all-resident").tpot_seconds
    for size in (3, 18):  # 3 and 18 experts of 1 MiB; the oracle is a bound, not a run to choose
        candidates = [r for r in results if r.cache_size == size and r.prefetcher != "oracle"]
        best = min(candidates, key=lambda r: r.tpot_seconds)
        assert (f"{size} MiB: {run_label(best)} {best.tpot_seconds * 1e3:.2f} ms, "
                f"{best.tpot_seconds / bound:.2f}x all-resident") in line
