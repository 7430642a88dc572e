"""The one validation layer (moe_offload.values): what each value accepts, what it refuses and in which words,
the same from the command line and from Python."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_offload import values
from moe_offload.cli.main import main
from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, ModelSpec, make_policy
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.format import write_trace
from moe_offload.trace.synthetic import zipf_trace
from moe_offload.values.options import component_options


def refused(function, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        function(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), ("0.5", 0.5), (1, 1.0), (np.float32(0.25), 0.25)])
def test_numbers_in_range_are_accepted(value, expected):
    assert values.number(value, "x", low=0, high=1) == expected


@pytest.mark.parametrize("value", ["abc", "nan", float("nan"), float("inf"), "inf", "-1", 1.5, True, None, [1],
                                   10**400])
def test_numbers_out_of_range_or_not_finite_are_refused(value):
    message = refused(values.number, value, "lcp.rho", low=0, high=1, low_open=True, high_open=True)
    assert message.startswith("lcp.rho ") and "must be a number in (0, 1)" in message


@pytest.mark.parametrize("value, expected", [(3, 3), ("3", 3), (3.0, 3), (np.int64(3), 3)])
def test_whole_numbers(value, expected):
    assert values.integer(value, "n", low=1, high=4) == expected


@pytest.mark.parametrize("value", [0, 5, "1e3", 2.5, float("inf"), "x", True, None])
def test_whole_numbers_refused(value):
    assert "must be a whole number from 1 to 4" in refused(values.integer, value, "n", low=1, high=4)


@pytest.mark.parametrize("text, expected", [("25%", 0.25), ("100%", 1.0), ("0.5", 0.5), ("1", 1.0)])
def test_shares(text, expected):
    assert values.share(text, "--fast-budget") == expected


@pytest.mark.parametrize("text, message", [
    ("150%", "a percentage must be in (0, 100]"), ("inf%", "a percentage must be in (0, 100]"),
    ("nan%", "a percentage must be in (0, 100]"), ("0%", "a percentage must be in (0, 100]"),
    ("1.5", "a fraction must be in (0, 1]"), ("x%", "is neither a percentage (25%) nor a fraction"),
])
def test_shares_refused(text, message):
    assert message in refused(values.share, text, "--cache-size")


def test_byte_counts_refuse_what_no_machine_holds():
    assert values.parse_bytes("4 GiB", "--cache-size") == 4 * 2**30
    for bad, message in (("1e400GB", "too large"), ("1e30 TB", "too large"), (10**400, "too large"),
                         ("0.2B", "at least one byte"), ("4 parsecs", "not a byte count")):
        assert message in refused(values.parse_bytes, bad, "--cache-size")


def test_expert_amounts_read_every_form_and_refuse_more_than_the_model():
    assert values.expert_amount("240", "--vram-budget", 1024) == 240
    assert values.expert_amount("25%", "--vram-budget", 1024) == 256
    assert values.expert_amount("0.25", "--vram-budget", 1024) == 256
    assert values.expert_amount("6MiB", "--vram-budget", 1024, expert_bytes=2**20) == 6
    for text, message in (("1025", "more than the model's 1,024"), ("0", "must be positive"),
                          ("6MiB", "give --expert-bytes"), ("lots", "neither a number of experts"),
                          ("inf", "a fraction must be in (0, 1]")):
        assert message in refused(values.expert_amount, text, "--vram-budget", 1024)


def test_cache_sizes_in_experts_and_in_bytes():
    assert values.cache_sizes("8, 25%,0.5,8", "--cache-size", 64) == [8, 16, 32]
    assert values.cache_sizes("2,1200B", "--cache-size", 64, 1000, in_bytes=True) == [1200, 2000]
    assert "a percentage must be in (0, 100]" in refused(values.cache_sizes, "150%", "--cache-size", 64)
    assert "more than the model's 64" in refused(values.cache_sizes, "65", "--cache-size", 64)
    assert "gives 0 experts" in refused(values.cache_sizes, "0.001", "--cache-size", 64)
    assert "names no size" in refused(values.cache_sizes, ",", "--cache-size", 64)


def test_budgets_in_bytes_as_the_runtime_reads_them():
    assert values.budget_bytes("30%", 1000, "--fast-budget") == 300
    assert values.budget_bytes("64KiB", 1000, "--fast-budget") == 65536
    assert values.budget_bytes("0.5", 1000, "--fast-budget") == 500
    assert "a percentage must be in (0, 100]" in refused(values.budget_bytes, "150%", 1000, "--fast-budget")
    # a bare number is experts (here of 100 bytes, 10 in all), bytes need a unit
    assert values.budget_bytes("3", 1000, "--fast-budget", expert_bytes=100) == 300
    assert values.budget_bytes("300B", 1000, "--fast-budget", expert_bytes=100) == 300
    assert "more than the model's 10 experts" in refused(values.budget_bytes, "16", 1000, "--fast-budget",
                                                         expert_bytes=100)
    assert "give bytes with a unit" in refused(values.budget_bytes, "16", 1000, "--fast-budget")


MiB = 2**20


def _experts_or_refused(read, value):
    """What a budget option makes of ``value`` on a model of 64 experts of 1 MiB: "16 experts", "64 MiB" or
    "refused", the words of docs/budgets.md's table."""
    try:
        amount, unit = read(value)
    except ConfigError:
        return "refused"
    return f"{amount:g} {'experts' if unit == 'experts' else 'MiB'}"


def _runtime(value):  # generate/serve --fast-budget and --host-budget, hardware measure, moe_offload.load
    count = values.budget_bytes(value, 64 * MiB, "--fast-budget", expert_bytes=MiB, experts=64)
    return (count // MiB, "experts") if not values.is_byte_size(value) else (count / MiB, "MiB")


def _timed(value):
    sizes = values.cache_sizes(value, "--cache-size", 64, MiB, in_bytes=True)
    return (sizes[0] // MiB, "experts") if not values.is_byte_size(value) else (sizes[0] / MiB, "MiB")


BUDGET_READERS = {  # each option of docs/budgets.md's table, read as its command reads it
    "`simulate --cache-size`": lambda v: (values.cache_sizes(v, "--cache-size", 64)[0], "experts"),
    "`simulate --timed --cache-size`": _timed,
    "`report --fast-memory`": lambda v: (_fast_memory_experts(v, 64, 2, MiB), "experts"),
    "`generate --fast-budget`, `serve --fast-budget`": _runtime,
    "`generate --host-budget`, `serve --host-budget`, `hardware measure --host-budget`": _runtime,
    "`moe_offload.load(fast_budget=..., host_budget=...)`": _runtime,
    "`configure --vram-budget`": lambda v: (values.expert_amount(v, "--vram-budget", 64, MiB), "experts"),
    "`train-eviction --cache-sizes`": lambda v: (values.cache_sizes(v, "--cache-sizes", 64)[0], "experts"),
}


def _fast_memory_experts(*args):
    from moe_offload.cli.report_cmd import fast_memory_experts

    return fast_memory_experts(*args)


def test_the_docs_table_of_budget_options_is_what_the_parser_does():
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "budgets.md").read_text()
    rows = [line.strip("|").split(" | ") for line in page.splitlines() if line.startswith("| `")]
    header = next(line for line in page.splitlines() if line.startswith("| option"))
    columns = [cell.strip(" `") for cell in header.strip("|").split(" | ")[1:]]
    assert columns == ["16", "25%", "0.25", "64MiB"]
    assert {row[0].strip() for row in rows} == set(BUDGET_READERS)
    for option, *cells in rows:
        for value, cell in zip(columns, cells):
            expected = cell.strip().split(" (")[0]  # "refused (why)" -> "refused"
            assert _experts_or_refused(BUDGET_READERS[option.strip()], value) == expected, (option, value)


def test_row_ranges():
    assert values.row_range("0:150", 299, "--rows") == (0, 150)
    assert values.row_range(":-1", 299, "--rows") == (0, 298)
    assert "is not START:END" in refused(values.row_range, "1:2:3", 299, "--rows")
    assert "within the 299 rows" in refused(values.row_range, "70:60", 299, "--rows")


def test_processes_are_bounded_by_the_tasks_and_the_cores():
    cores = values.cores()
    assert values.worker_count(12, tasks=2) == min(2, cores)  # 12 jobs on 2 tasks start 2 processes, not 12
    assert values.worker_count(cores + 10, tasks=1000) == cores
    assert values.worker_count(1, tasks=50) == 1
    assert "must be a whole number of at least 1" in refused(values.jobs, 0)


def test_devices():
    import torch

    assert values.device("cpu") == "cpu"
    assert "is not a device: cpu, cuda or cuda:N" in refused(values.device, "tpu")
    assert "is not a device" in refused(values.device, "cpu:3")
    if not torch.cuda.is_available():
        assert "has no CUDA device; use cpu" in refused(values.device, "cuda")
    else:
        assert values.device("cuda") == "cuda"
    assert "cuda:99" in refused(values.device, "cuda:99")


def test_context_limits():
    assert values.context_room(1000, 1024) == 24
    assert values.generation_length(24, 1000, 1024) == 24
    assert "reads at most 1,024 positions" in refused(values.context_room, 1500, 1024)
    assert "at most 0 new tokens fit" in refused(values.generation_length, 1, 1024, 1024)
    message = refused(values.generation_length, 10**9, 1000, 1024)
    assert message.startswith("--max-new-tokens 1000000000:") and "at most 24 new tokens fit" in message


def test_memory_bound():
    values.memory(1024, "a small array")
    assert "more than this machine's" in refused(values.memory, 2**62, "a trace of 10^12 tokens")


@pytest.mark.parametrize("raw, message", [
    ("abc", "lcp.rho 'abc': must be a number in (0, 1)"),
    ("-1", "lcp.rho -1: must be a number in (0, 1)"),
    ("NaN", "lcp.rho nan: must be a number in (0, 1) (a finite one)"),
    ("[[[[[[1]]]]]]", "lcp.rho [[[[[[1]]]]]]: must be a number in (0, 1)"),
])
def test_a_bad_policy_option_reads_the_same_from_the_command_line_and_from_python(tmp_path, capsys, raw, message):
    trace = zipf_trace(num_layers=2, num_experts=4, top_k=2, length=20, a=1.0, b=0.0, seed=0)
    path = str(write_trace(trace, tmp_path / "z.parquet"))
    assert main(["simulate", path, "--policy", "lcp", "--cache-size", "4", "--policy-option", f"lcp.rho={raw}"]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-offload: error: {message}\n", err
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    with pytest.raises(ConfigError) as error:
        replay(ReplayInput.of(trace), "lcp", 4, options={"rho": value})
    assert str(error.value) == message


def test_unknown_options_name_those_the_component_takes(capsys):
    with pytest.raises(ConfigError, match="policy 'lcp' has no option speed; it takes omega=128.0, rho=0.25"):
        make_policy("lcp", ModelSpec(2, 4, 2), options={"speed": 1})
    assert main(["simulate", "--policy", "lcp", "--policy-option", "lcp.speed=1"]) == 2
    assert "policy 'lcp' has no option speed" in capsys.readouterr().err
    assert main(["simulate", "--policy", "lru", "--policy-option", "lcp.rho=0.5"]) == 2
    err = capsys.readouterr().err
    assert "lcp is not run here (--policy lru)" in err and err.count("\n") == 1


def test_the_option_parser_keeps_strings_and_json():
    options = component_options(["learned.model_path=/x/y.npz", "lcp.rho=0.5", "lcp.omega=1e3"],
                                       "--policy-option", "POLICY.NAME=VALUE", "policy",
                                       lambda name: POLICIES[name].policy, skip=("seed",))
    assert options == {"learned": {"model_path": "/x/y.npz"}, "lcp": {"rho": 0.5, "omega": 1000.0}}
    assert "is not POLICY.NAME=VALUE" in refused(component_options, ["lcp.rho"], "--policy-option",
                                                 "POLICY.NAME=VALUE", "policy", lambda name: POLICIES[name].policy)
