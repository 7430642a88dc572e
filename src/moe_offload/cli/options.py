"""The options several commands share, declared once: the model, the compute, the budgets, the policy, the
prefetcher, the hardware, MoEpic's split, the replay's runs; and the Plan the runtime's commands make of them.

A command adds the groups it takes (``add_model``, ``add_budget``, ...) and keeps in its own file only what
is its own. ``generate`` and ``serve`` run one policy and at most one prefetcher; their options become a Plan
through ``plan_from_args`` (plan/make.py checks it once), before the model is packed or loaded. ``simulate``
compares many (comma-separated ``--policy``/``--prefetch``); ``report``, ``configure`` and ``sweep`` take the
hardware and the replay's options. Where an option's sentence differs between commands (what ``--hardware``
is used for), the command passes its own help; the flag, its metavar and its default are these.
"""

from __future__ import annotations

import argparse
import os

from moe_offload.errors import ConfigError
from moe_offload.plan.choices import MATCHERS
from moe_offload.policies import policy_info
from moe_offload.values import integer
from moe_offload.values.options import check_options_used, component_options, option_defaults

POLICY_OPTION, PREFETCH_OPTION = "POLICY.NAME=VALUE", "PREFETCHER.NAME=VALUE"
DEFAULT_JOBS = min(2, os.cpu_count() or 1)


# ------------------------------------------------------------------------------------------------- model
def add_model(parser) -> None:
    """``--model``, ``--gguf-file`` and ``--expert-dtype``: the checkpoint the runtime packs and runs."""
    parser.add_argument("--model", default="tiny", metavar="tiny|DIR|ORG/NAME[@REV]|FILE.gguf",
                        help="model: tiny (the default), a checkpoint or packed directory, a Hugging Face hub "
                             "id (from the hub cache, downloaded where the hub is reachable; HF_HOME, "
                             "HF_HUB_OFFLINE hold) or a GGUF file (needs the 'gguf' extra)")
    add_gguf_file(parser)
    parser.add_argument("--expert-dtype", default=None, metavar="float16|bfloat16|int8|int4",
                        help="the experts' stored dtype: a checkpoint is packed once per dtype (int8/int4: "
                             "group-wise with scales; the budget counts their bytes); default: the checkpoint's")


def add_gguf_file(parser) -> None:
    """``--gguf-file``: which GGUF file of a hub repository ``--model`` names (models/gguf.py)."""
    parser.add_argument("--gguf-file", default=None, metavar="FILE.gguf",
                        help="with a hub id: read this GGUF file of the repository (dequantized by transformers, "
                             "then packed; needs the 'gguf' extra)")


# ----------------------------------------------------------------------------------------------- compute
def add_compute(parser) -> None:
    """The fast tier's dtype and expert form, the device and PyTorch's threads."""
    parser.add_argument("--dtype", default=None, metavar="float32|bfloat16|float16",
                        help="the fast tier's compute dtype (weights and activations); default: the measured "
                             "profile's choice (--hardware FILE from `hardware measure`), else float32 on a CPU and "
                             "the stored dtype on a GPU")
    parser.add_argument("--expert-compute", default=None, metavar="auto|per-use|on-arrival|kernel",
                        help="how the fast tier holds and computes with int8/int4 experts: dequantized at every "
                             "use, dequantized once on arrival into float slots (fewer fit in the budget), or "
                             "PyTorch's weight-only int4 kernel on a CPU; default auto: the kernel for int4 "
                             "computed in bfloat16 on a CPU, else per-use; a measured --hardware "
                             "profile's choice first")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", default=None, metavar="N",
                        help="PyTorch's CPU threads in this process (default: PyTorch's, one per core; the README's "
                             "'CPU threads' says what the count changed on a 2-core machine)")
    parser.add_argument("--bypass-page-cache", action="store_true",
                        help="drop expert files from the page cache before each read (honest SSD timings)")


# ----------------------------------------------------------------------------------------------- budgets
def add_budget(parser) -> None:
    """``--fast-budget`` and ``--host-budget`` (values.budget_bytes reads them, through the Plan)."""
    parser.add_argument("--fast-budget", default="50%", metavar="SIZE|P%",
                        help="fast-tier budget: a number of experts (16), a share of all experts (30%%, 0.3) or bytes "
                             "with a unit (64MiB; docs/budgets.md); default 50%%")
    parser.add_argument("--host-budget", default=None, metavar="SIZE|P%",
                        help="add a host-memory tier of this budget between the files and the fast tier: experts, a "
                             "share or bytes with a unit, as --fast-budget")


# ------------------------------------------------------------------------------------------------ policy
def add_policy(parser, *, many: bool = False, help: str | None = None) -> None:
    """``--policy`` (one name; ``many``: comma-separated names) and ``--policy-option``."""
    parser.add_argument("--policy", default=None if many else "lru",
                        help=help or "eviction policy (default lru; see `moe-offload policies`)")
    parser.add_argument("--policy-option", action="append", default=[], metavar=POLICY_OPTION,
                        help="a policy parameter, e.g. lcp.rho=0.5 or learned.model_path=model.npz (repeatable)")


def add_placement(parser) -> None:
    """The placing policies' own options (``--profile``, ``--fast-layers``) and Fiddler's rule."""
    parser.add_argument("--profile", default=None, metavar="TRACE",
                        help="the trace a placing policy chooses its resident experts from (static-freq, pinned-lru: "
                             "the most frequent); the experts it leaves out are computed on the host")
    parser.add_argument("--fast-layers", default=None, metavar="N",
                        help="static-layers: the last N layers' experts in the fast tier, the others computed on "
                             "the host (llama.cpp's --n-cpu-moe L-N; default: as many whole layers as fit)")
    add_fetch_or_compute(parser, "compute a missed expert on the host CPU from the host tier's copy instead of "
                                 "loading it when --hardware's costs say that is faster, per expert and pass "
                                 "(Fiddler's rule, as simulate --timed --fetch-or-compute decides); for a dynamic "
                                 "--policy")


def add_fetch_or_compute(parser, help: str) -> None:
    parser.add_argument("--fetch-or-compute", action="store_true", help=help)


# ---------------------------------------------------------------------------------------------- prefetch
def add_prefetch(parser, *, many: bool = False, help: str | None = None) -> None:
    """``--prefetch`` ('none': no prefetcher; ``many``: comma-separated names) and ``--prefetch-option``."""
    parser.add_argument("--prefetch", default="none", metavar="NAME[,NAME]" if many else "NAME",
                        help=help or "prefetcher, or 'none' for demand loading only (default none)")
    parser.add_argument("--prefetch-option", action="append", default=[], metavar=PREFETCH_OPTION,
                        help="a prefetcher parameter, e.g. oracle.distance=2 (repeatable)")


def add_live_prefetch(parser) -> None:
    """The runtime's prefetcher options beside ``add_prefetch``'s: its history and where fMoE's matcher runs."""
    parser.add_argument("--prefetch-history", default=None, metavar="TRACE",
                        help="trace the prefetcher learns from first (default for --model tiny: the bundled "
                             "recorded trace, for the prefetchers that need a history)")
    parser.add_argument("--matcher", default="async", choices=MATCHERS,
                        help="where fMoE's matcher searches: on a thread of its own, its proposals applied when they "
                             "arrive (async, the paper's; default), on the decode thread (inline), or on its thread "
                             "with the decode thread waiting for each result (lockstep)")


# ---------------------------------------------------------------------------------------------- hardware
def add_hardware(parser, help: str, default: str | None = None) -> None:
    """``--hardware``: a preset's name or a profile file (`moe-offload hardware list`); ``help`` says what the
    command uses it for."""
    parser.add_argument("--hardware", metavar="PRESET|FILE", default=default, help=help)


def add_expert_bytes(parser, help: str = "bytes of one expert (default: the trace's metadata)") -> None:
    parser.add_argument("--expert-bytes", metavar="BYTES", help=help)


# ------------------------------------------------------------------------------------------------- split
def add_split(parser, *, split_help: str, reconfigure_help: str, granularity_default: float | None) -> None:
    """MoEpic's split experts (``--split-config``) and its online configurator (``--reconfigure-every``,
    ``--granularity``)."""
    parser.add_argument("--split-config", default=None, metavar="FILE.json", help=split_help)
    parser.add_argument("--reconfigure-every", type=int, metavar="TAU", help=reconfigure_help)
    add_granularity(parser, granularity_default)


def add_granularity(parser, default: float | None = 0.01) -> None:
    parser.add_argument("--granularity", type=float, default=default, metavar="ZETA",
                        help="share of the budget the online configurator moves between two layers per step "
                             "(default 0.01, the paper's)")


# ------------------------------------------------------------------------------------------- replay runs
def add_replay_runs(parser, engines: tuple[str, ...], engine_help: str, engine_flag: str = "--engine") -> None:
    """``--seed``, ``--jobs`` and how the replay runs (``--engine``; report: ``--replay-engine``) of the commands
    that replay (simulate, report)."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the randomized policies (default 0)")
    add_jobs(parser)
    parser.add_argument(engine_flag, choices=engines, default="auto", help=engine_help)


def add_jobs(parser) -> None:
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="worker processes (default: up to 2)")


# -------------------------------------------------------------------------------------- the runtime's plan
def add_runtime(parser) -> None:
    """Every option of the offloaded engine (generate and serve): the model, the compute, the budgets, the
    policy and its placement, the prefetcher and the hardware."""
    add_model(parser)
    add_compute(parser)
    add_budget(parser)
    add_policy(parser)
    add_placement(parser)
    add_prefetch(parser)
    add_live_prefetch(parser)
    add_hardware(parser, "the hardware profile whose costs --fetch-or-compute decides with, whose timings the "
                         "online configurator plans with and whose link sets how many experts a prefetcher "
                         "moves per layer (MoEpic's Y, as simulate --timed counts it; default desktop-rtx4090; "
                         "`moe-offload hardware list`, `moe-offload hardware measure`); a profile `hardware "
                         "measure` wrote also gives --dtype and --expert-compute where they are not given")


def plan_from_args(args: argparse.Namespace, **extra):
    """The checked Plan of a runtime command's options (``extra``: the command's own, such as ``max_batch``),
    made before the model is packed or loaded: a bad option is refused now, in one line."""
    from moe_offload.plan import make_plan

    check_prefetch(args)
    policy_options, prefetch_options = runtime_component_options(args)
    return make_plan(args.model, fast_budget=args.fast_budget, host_budget=args.host_budget, policy=args.policy,
                     policy_options=policy_options, prefetch=args.prefetch, prefetch_options=prefetch_options,
                     prefetch_history=args.prefetch_history, expert_dtype=args.expert_dtype, dtype=args.dtype,
                     expert_compute=args.expert_compute, device=args.device, hardware=args.hardware,
                     fetch_or_compute=args.fetch_or_compute, bypass_page_cache=args.bypass_page_cache,
                     matcher=args.matcher, **extra)


def check_prefetch(args: argparse.Namespace) -> None:
    """--prefetch and --prefetch-history of generate and serve, checked before anything loads. 'none' (the
    default, simulate --timed's word too) is no prefetcher: ``args.prefetch`` becomes None. Refused now, not after
    the model has loaded: a prefetcher that reads the future routing (the engine runs live prompts), and one that
    learns from past sequences without a history (the tiny model brings its own)."""
    from moe_offload.inputs import check_input
    from moe_offload.prefetch import prefetcher_info

    if args.prefetch.strip() == "none":
        if args.prefetch_history is not None:
            raise ConfigError("--prefetch-history teaches a prefetcher: add --prefetch NAME")
        args.prefetch = None
        return
    prefetcher = prefetcher_info(args.prefetch)
    if prefetcher.reads_future:
        raise ConfigError(f"--prefetch {args.prefetch} reads the future routing, which a running engine does not "
                          "know; it is a bound of `moe-offload simulate --timed`")
    if args.prefetch_history is not None:
        from moe_offload.bundled import trace_path

        check_input(trace_path(args.prefetch_history), "--prefetch-history trace")
    elif prefetcher.needs_history and args.model != "tiny":
        raise ConfigError(f"--prefetch {args.prefetch} predicts from past sequences: give it a trace of this model "
                          "with --prefetch-history TRACE (`moe-offload record` writes one)")


def apply_threads(args: argparse.Namespace) -> None:
    """``--threads``: checked, then PyTorch's intra-op threads for this process (before the model loads)."""
    if args.threads is None:
        return
    import torch

    from moe_offload import values

    torch.set_num_threads(values.integer(args.threads, "--threads", low=1, high=values.cores(),
                                         why="the cores of this machine"))


def runtime_component_options(args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """(the policy's options, the prefetcher's) of a command that runs one policy and at most one prefetcher
    (generate, serve): --policy-option and --prefetch-option, an option of another component refused, with
    ``--profile`` and ``--fast-layers`` among the policy's."""
    from moe_offload.prefetch import prefetcher_info

    policy_options = policy_options_of(args, [args.policy]).get(args.policy)
    prefetchers = component_options(args.prefetch_option, "--prefetch-option", PREFETCH_OPTION, "prefetcher",
                                    prefetcher_info)
    check_options_used(prefetchers, [args.prefetch] if args.prefetch else [], "--prefetch-option", "--prefetch")
    takes = option_defaults(policy_info(args.policy).policy)
    for flag, option, value in (("--profile", "profile", args.profile),
                                ("--fast-layers", "fast_layers", args.fast_layers)):
        if value is None:
            continue
        if option not in takes:
            raise ConfigError(f"{flag}: policy {args.policy!r} takes no {option} (static-freq and pinned-lru take "
                              "--profile, static-layers --fast-layers)")
        if option in (policy_options or {}):
            raise ConfigError(f"{flag} and --policy-option {args.policy}.{option}=... say the same thing: give one")
        value = _profile(value) if option == "profile" else integer(value, flag, low=0)
        policy_options = {**(policy_options or {}), option: value}
    return policy_options, prefetchers.get(args.prefetch) if args.prefetch else None


def policy_options_of(args, policies: list[str]) -> dict[str, dict]:
    """--policy-option as {policy: {option: value}}; an option of a policy that is not run is refused."""
    options = component_options(args.policy_option, "--policy-option", POLICY_OPTION, "policy",
                                lambda name: policy_info(name).policy, skip=("seed",),
                                also=lambda name: policy_info(name).cache_options)
    check_options_used(options, policies, "--policy-option", "--policy")
    return options


def _profile(path) -> str:
    """``--profile``'s trace, read once here so that a bad one is refused before the model loads."""
    from moe_offload.errors import TraceError
    from moe_offload.inputs import check_input
    from moe_offload.trace.format import read_trace

    try:
        read_trace(check_input(path, "profile trace"))
    except TraceError as exc:
        raise ConfigError(f"--profile: {exc}") from None
    return str(path)
