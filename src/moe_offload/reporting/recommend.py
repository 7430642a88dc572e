"""What to run: the report's fastest configuration as `moe-offload generate` and `moe-offload serve` commands.

The configuration is the timed run of least TPOT that a user can make (no oracle, not all resident:
reporting/latency.py), or without timed runs (no expert size) the online policy with the most replay hits.
The options are those of cli/generate_cmd.py's engine arguments, which `serve` shares: ``--fast-budget`` in
exact bytes (the budget the report measured; a share of all experts when the trace does not give an
expert's size), ``--policy``, ``--prefetch``; MoEpic's split experts run from
the configuration `moe-offload configure --json` writes (``--split-config``), which `serve` does not take.
"""

from __future__ import annotations

import shlex

from moe_offload.hardware.profile import format_bytes
from moe_offload.reporting.latency import MOEPIC_POLICY, Latency
from moe_offload.trace.format import TraceMeta

BUNDLED_MODEL = "moe-offload/tiny-mixtral"  # the recording of `--model tiny` names its model so


def exact_size(count: int) -> str:
    """``count`` bytes as `--fast-budget` reads them back exactly: a binary unit when one divides it."""
    text = format_bytes(count)
    return text.replace(" ", "") if "." not in text and not text.endswith(" B") and "i" in text else str(count)


def model_argument(meta: TraceMeta) -> str:
    return "tiny" if meta.model == BUNDLED_MODEL else "MODEL_DIR"


def commands(meta: TraceMeta, trace_name: str, hardware: str, cache_size: int, expert_bytes: int | None,
             latency: Latency | None, best_policy: str) -> list[list[str]]:
    """The commands, each an argument list after ``moe-offload``; MODEL_DIR stands for the checkpoint directory
    of the trace's model unless it is the bundled one."""
    model = model_argument(meta)
    best = latency.best() if latency is not None else None
    if expert_bytes:
        budget = exact_size(cache_size * expert_bytes)
    else:  # a share of all experts' bytes, which the runtime knows from the model
        budget = f"{100 * cache_size / meta.num_expert_slots:.6g}%"
    prompt = "Why is the sky blue?"
    if best is not None and latency.moepic is best:
        config = "split.json"
        split_budget = latency.moepic_config["budget_experts"]
        return [["configure", trace_name, "--vram-budget", str(split_budget), "--hardware", hardware, "--json"],
                ["generate", prompt, "--model", model, "--fast-budget", exact_size(best.cache_bytes),
                 "--split-config", config, "--policy", MOEPIC_POLICY, "--prefetch", "moepic", "--hardware", hardware]]
    policy = best.policy if best is not None else best_policy
    options = ["--model", model, "--fast-budget", budget, "--policy", policy]
    if best is not None and best.prefetcher is not None:
        options += ["--prefetch", best.prefetcher]
    return [["generate", prompt, *options], ["serve", *options]]


def command_lines(argument_lists: list[list[str]]) -> list[str]:
    """Shell lines; `configure --json` writes the split configuration the next command reads."""
    lines = []
    for arguments in argument_lists:
        line = "moe-offload " + shlex.join(arguments)
        if arguments[0] == "configure":
            line += " > split.json"
        lines.append(line)
    return lines
