"""The Plan (plan/plan.py): made and checked once from the options, importable without PyTorch, naming the
placements; the timed simulator's prediction of a plan and the runtime's run of it report the same
configuration back."""

import subprocess
import sys

import pytest

from moe_offload.errors import ConfigError
from moe_offload.plan import Plan, Reconfiguration, make_plan


def imported(module: str) -> tuple[set[str], bool]:
    """(the packages of moe_offload that importing ``module`` imports, whether it imports torch), in a fresh
    interpreter."""
    code = (f"import sys, {module}; "
            "print(' '.join({m.split('.')[1] for m in sys.modules if m.startswith('moe_offload.')}), "
            "'torch' in sys.modules, sep='|')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    packages, torch = out.strip().split("|")
    return set(packages.split()), torch == "True"


def test_the_plan_imports_neither_torch_nor_the_layers_above_it():
    packages, torch = imported("moe_offload.plan")
    assert "plan" in packages and not torch
    assert not {"simulator", "runtime", "reporting", "cli", "server"} & packages
    assert imported("moe_offload.simulator.timed")[1] is False  # the timed simulator, built from a plan


@pytest.mark.parametrize("options, problem", [
    (dict(dtype="float8"), "--dtype 'float8': choose from float32, bfloat16, float16"),
    (dict(expert_compute="fast"), "--expert-compute 'fast'"),
    (dict(expert_dtype="int3"), "--expert-dtype 'int3'"),
    (dict(matcher="later"), "matcher 'later'"),
    (dict(max_batch=0), "max_batch"),
    (dict(fast_budget="lots"), "--fast-budget"),
    (dict(policy="nope"), "nope"),
    (dict(policy_options={"rho": 1}), "policy 'lru' has no option rho"),
    (dict(prefetch="topk", prefetch_options={"depth": 1}), "prefetcher 'topk' has no option depth"),
    (dict(granularity=0.1), "--granularity belongs to the online configuration"),
    (dict(reconfigure_every=0), "tau must be a positive number"),
    (dict(reconfigure_every=5, granularity=2), "zeta must be in (0, 1)"),
    (dict(reconfigure_every=5, preload=True), "does not preload"),
    (dict(hardware="no-such-preset"), "no-such-preset"),
    (dict(policy="static-layers", fetch_or_compute=True), "static placement that loads none"),
    (dict(policy="static-layers", prefetch="topk"), "nothing for the prefetcher 'topk'"),
    (dict(policy="static-freq"), "chooses its experts from a profile"),
    (dict(policy="static-layers", split_config="split.json"), "does not run with a split configuration"),
])
def test_a_bad_option_is_refused_once_in_one_line(options, problem):
    with pytest.raises(ConfigError, match=None) as refusal:
        make_plan("tiny", **options)
    assert problem in str(refusal.value) and "\n" not in str(refusal.value)


def test_the_placements_the_engine_settings_need_are_named_by_the_plan():
    # llama.cpp's --n-cpu-moe (whole layers on the host), KTransformers' static GPU experts, streamed experts
    assert make_plan(policy="static-layers", policy_options={"fast_layers": 2}).placement == "host-layers"
    assert make_plan(policy="static-freq", replay="trace.parquet").placement == "static-experts"
    assert make_plan(policy="pinned-lru", policy_options={"profile": "t.parquet"}).placement == "pinned"
    streamed = make_plan(policy="lru", fetch_or_compute=True)
    assert (streamed.placement, streamed.admission) == ("streamed", "fetch-or-compute")
    # a placement computes what it leaves out on the host: every expert there unless a host budget is given
    assert make_plan(policy="static-layers").host_budget == "100%"
    assert make_plan(policy="static-layers", host_budget="1GiB").host_budget == "1GiB"
    assert make_plan(policy="lru").host_budget is None


def test_budgets_are_whole_experts_as_the_runtime_rounds_them():
    plan = make_plan(fast_budget="30%", host_budget="2KiB")
    assert plan.fast_experts(expert_bytes=100, experts=64) == 19  # floor(0.3 x 6400 / 100)
    assert plan.host_experts(expert_bytes=100, experts=64) == 20  # floor(2048 / 100)
    assert make_plan(fast_budget="1MiB").fast_experts(expert_bytes=100, experts=64) == 64  # at most all
    assert make_plan(fast_budget="16").fast_experts(expert_bytes=100, experts=64) == 16  # a bare number is experts
    assert make_plan(policy="static-layers", host_budget="8").host_experts(expert_bytes=100, experts=64) == 8


def test_the_plan_is_frozen_and_describes_itself_as_its_options_say():
    plan = make_plan("tiny", fast_budget="25%", policy="lcp", policy_options={"rho": 0.5}, prefetch="topk",
                     reconfigure_every=10, split_config="split.json", max_batch=4)
    with pytest.raises(AttributeError):
        plan.policy = "lru"
    assert plan.reconfiguration == Reconfiguration(10, 0.01) and plan.split
    described = plan.describe()
    assert (described["fast_budget"], described["policy"], described["policy_options"], described["prefetch"],
            described["split_config"], described["reconfiguration"], described["max_batch"]) == \
        ("25%", "lcp", {"rho": 0.5}, "topk", "split.json", {"every": 10, "granularity": 0.01}, 4)
    assert plan.options() == ["--model", "tiny", "--fast-budget", "25%", "--policy", "lcp", "--prefetch", "topk",
                              "--split-config", "split.json", "--reconfigure-every", "10", "--granularity", "0.01",
                              "--policy-option", "lcp.rho=0.5"]
    assert make_plan("tiny", prefetch="none") == Plan(model="tiny")  # 'none' is no prefetcher


def test_the_generate_options_read_back_as_the_same_plan():
    from moe_offload.cli.main import build_parser
    from moe_offload.cli.options import plan_from_args

    plan = make_plan("tiny", fast_budget="25%", policy="lcp", policy_options={"rho": 0.5}, prefetch="topk")
    args = build_parser().parse_args(["generate", "hi", *plan.options()])
    assert plan_from_args(args) == plan


def test_a_plans_timed_prediction_and_its_runtime_run_report_the_same_configuration():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import moe_offload
    from moe_offload.bundled import trace_path
    from moe_offload.runtime.engine import OffloadEngine
    from moe_offload.simulator.timed import simulate_plan
    from moe_offload.trace.format import read_trace

    plan = make_plan("tiny", fast_budget="50%", policy="lru", prefetch="topk", device="cpu")
    predicted = simulate_plan(read_trace(trace_path("tiny")), plan)
    with OffloadEngine(plan) as engine:
        ran = engine.generate([1, 2, 3], max_new_tokens=2).stats
        assert engine.plan is plan
    expected = plan.describe()
    assert predicted.configuration == ran.configuration == expected
    # the same rules made both: the same policy, prefetcher and whole experts in the fast tier (half of 8 x 8)
    assert (predicted.policy, predicted.prefetcher, predicted.cache_size) == \
        (ran.policy, ran.prefetcher, ran.cache_size) == ("lru", "topk", 32)
    with moe_offload.load("tiny", fast_budget="50%", policy="lru", prefetch="topk", device="cpu") as engine:
        assert engine.plan == plan  # the front door makes the same plan from the same keywords
