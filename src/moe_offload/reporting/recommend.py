"""What to run: the report's fastest configuration as `moe-offload generate` and `moe-offload serve` commands.

The configuration is the timed run of least TPOT that a user can make (no oracle, not all resident:
reporting/latency.py), or without timed runs (no expert size) the online policy with the most replay hits.
It is made a Plan (plan/plan.py), the one the runtime would run, and written back as that plan's options
(``Plan.options``, which `generate` and `serve` read through cli/options.py): ``--fast-budget`` as the
report's number of experts (a bare number is experts for every budget option, docs/budgets.md; the runtime
sizes an expert in the dtype it computes in, which may differ from the trace's expert size, so a count means
the same experts on every device), ``--policy``,
``--prefetch``; MoEpic's split experts run from the configuration `moe-offload configure --json` writes
(``--split-config``), which `serve` does not take.
"""

from __future__ import annotations

import shlex

from moe_offload.models.hub import HUB_ID
from moe_offload.plan import make_plan
from moe_offload.reporting.latency import MOEPIC_POLICY, Latency
from moe_offload.trace.format import TraceMeta

BUNDLED_MODEL = "moe-offload/tiny-mixtral"  # the recording of `--model tiny` names its model so


def model_argument(meta: TraceMeta) -> str:
    """``--model`` for the trace's model: ``tiny``, its hub id when the trace names one (the runtime resolves
    ORG/NAME through the hub cache, models/hub.py), else MODEL_DIR for the user's checkpoint directory."""
    if meta.model == BUNDLED_MODEL:
        return "tiny"
    return meta.model if HUB_ID.fullmatch(meta.model) else "MODEL_DIR"


def commands(meta: TraceMeta, trace_name: str, hardware: str, cache_size: int, expert_bytes: int | None,
             latency: Latency | None, best_policy: str) -> list[list[str]]:
    """The commands, each an argument list after ``moe-offload``; MODEL_DIR stands for the checkpoint directory
    of the trace's model unless it is the bundled one or a hub id."""
    model = model_argument(meta)
    best = latency.best() if latency is not None else None
    budget = str(cache_size)
    prompt = "Why is the sky blue?"
    if best is not None and latency.moepic is best:
        config = "split.json"
        plan = make_plan(model, fast_budget=budget, policy=MOEPIC_POLICY, prefetch="moepic", split_config=config)
        # configure's --vram-budget is the whole VRAM: it takes the prefetch buffer out itself
        return [["configure", trace_name, "--vram-budget", str(cache_size), "--hardware", hardware, "--json"],
                ["generate", prompt, *plan.options()]]
    plan = make_plan(model, fast_budget=budget, policy=best.policy if best is not None else best_policy,
                     prefetch=best.prefetcher if best is not None else None)
    return [["generate", prompt, *plan.options()], ["serve", *plan.options()]]


def command_lines(argument_lists: list[list[str]]) -> list[str]:
    """Shell lines; `configure --json` writes the split configuration the next command reads."""
    lines = []
    for arguments in argument_lists:
        line = "moe-offload " + shlex.join(arguments)
        if arguments[0] == "configure":
            line += " > split.json"
        lines.append(line)
    return lines
