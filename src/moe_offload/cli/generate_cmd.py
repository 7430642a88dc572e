"""`moe-offload generate`: stream text from an MoE model whose experts are offloaded (runtime/engine.py)."""

from __future__ import annotations

import argparse
import sys

from moe_offload.cli.simulate_cmd import POLICY_OPTION, PREFETCH_OPTION, runtime_options
from moe_offload.runtime.matcher import MATCHERS


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text with experts offloaded to slower tiers, and report what it cost",
        description="Greedy generation with a packed MoE model (the bundled 'tiny', a checkpoint directory, which is "
                    "packed once into ~/.cache/moe-offload, or a directory written by `moe-offload pack`). The "
                    "experts live in the packed files and are cached in a fast tier of --fast-budget bytes by the "
                    "eviction policy, with an optional prefetcher. The tokens are exactly those of the all-resident "
                    "model. Ends with tokens/s, TTFT, TPOT, hit rate, prefetch precision and recall, bytes moved "
                    "per link and stall time.")
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    add_engine_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="default 64; a prompt plus N beyond the model's context is refused")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the bundled model's chat format (User: ...\\nAssistant:)")
    parser.add_argument("--split-config", default=None, metavar="FILE.json",
                        help="run MoEpic's split experts as `moe-offload configure --json` wrote them: per layer, the "
                             "cached top segments and the split ratio, plus a buffer of top-k experts, all within "
                             "--fast-budget; the tokens are the all-resident model's computing with the same split; "
                             "--prefetch moepic takes the configuration's prefetch count per layer; --host-budget adds a host tier")
    parser.add_argument("--reconfigure-every", type=int, metavar="TAU",
                        help="MoEpic's online configurator (paper 004, Algorithm 1): rerun the split configuration "
                             "every TAU tokens from the routing seen so far and resize the running tops between two "
                             "passes (the paper's tau is 5000); starts from --split-config, or from the uniform "
                             "allocation with split ratio 0.5 on --fast-budget less the buffer of top-k experts")
    parser.add_argument("--granularity", type=float, default=None, metavar="ZETA",
                        help="share of the budget the online configurator moves between two layers per step "
                             "(default 0.01, the paper's)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write the run's result record, with the prompt, the text and the token ids, as JSON")
    parser.set_defaults(run=run)


def add_engine_arguments(parser) -> None:
    """The options of the offloaded engine, shared by ``generate`` and ``serve``."""
    parser.add_argument("--model", default="tiny", metavar="tiny|DIR|ORG/NAME[@REV]|FILE.gguf",
                        help="model: tiny (the default), a checkpoint or packed directory, a Hugging Face hub "
                             "id (from the hub cache, downloaded where the hub is reachable; HF_HOME, "
                             "HF_HUB_OFFLINE hold) or a GGUF file (needs the 'gguf' extra)")
    add_gguf_argument(parser)
    parser.add_argument("--expert-dtype", default=None, metavar="float16|bfloat16|int8|int4",
                        help="the experts' stored dtype: a checkpoint is packed once per dtype (int8/int4: "
                             "group-wise with scales; the budget counts their bytes); default: the checkpoint's")
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
    parser.add_argument("--fast-budget", default="50%", metavar="SIZE|P%",
                        help="fast-tier budget: a number of experts (16), a share of all experts (30%%, 0.3) or bytes "
                             "with a unit (64MiB; docs/budgets.md); default 50%%")
    parser.add_argument("--host-budget", default=None, metavar="SIZE|P%",
                        help="add a host-memory tier of this budget between the files and the fast tier: experts, a "
                             "share or bytes with a unit, as --fast-budget")
    parser.add_argument("--policy", default="lru", help="eviction policy (default lru; see `moe-offload policies`)")
    parser.add_argument("--prefetch", default="none", metavar="NAME",
                        help="prefetcher, or 'none' for demand loading only (default none)")
    parser.add_argument("--prefetch-history", default=None, metavar="TRACE",
                        help="trace the prefetcher learns from first (default for --model tiny: the bundled "
                             "recorded trace, for the prefetchers that need a history)")
    parser.add_argument("--policy-option", action="append", default=[], metavar=POLICY_OPTION)
    parser.add_argument("--profile", default=None, metavar="TRACE",
                        help="the trace a placing policy chooses its resident experts from (static-freq, pinned-lru: "
                             "the most frequent); the experts it leaves out are computed on the host")
    parser.add_argument("--fast-layers", default=None, metavar="N",
                        help="static-layers: the last N layers' experts in the fast tier, the others computed on "
                             "the host (llama.cpp's --n-cpu-moe L-N; default: as many whole layers as fit)")
    parser.add_argument("--fetch-or-compute", action="store_true",
                        help="compute a missed expert on the host CPU from the host tier's copy instead of loading "
                             "it when --hardware's costs say that is faster, per expert and pass (Fiddler's rule, as "
                             "simulate --timed --fetch-or-compute decides); for a dynamic --policy")
    parser.add_argument("--hardware", metavar="PRESET|FILE",
                        help="the hardware profile whose costs --fetch-or-compute decides with, whose timings the "
                             "online configurator plans with and whose link sets how many experts a prefetcher "
                             "moves per layer (MoEpic's Y, as simulate --timed counts it; default desktop-rtx4090; "
                             "`moe-offload hardware list`, `moe-offload hardware measure`); a profile `hardware "
                             "measure` wrote also gives --dtype and --expert-compute where they are not given")
    parser.add_argument("--prefetch-option", action="append", default=[], metavar=PREFETCH_OPTION)
    parser.add_argument("--bypass-page-cache", action="store_true",
                        help="drop expert files from the page cache before each read (honest SSD timings)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", default=None, metavar="N",
                        help="PyTorch's CPU threads in this process (default: PyTorch's, one per core; the README's "
                             "'CPU threads' says what the count changed on a 2-core machine)")
    parser.add_argument("--matcher", default="async", choices=MATCHERS,
                        help="where fMoE's matcher searches: on a thread of its own, its proposals applied when they "
                             "arrive (async, the paper's; default), on the decode thread (inline), or on its thread "
                             "with the decode thread waiting for each result (lockstep)")


def add_gguf_argument(parser) -> None:
    """``--gguf-file``: which GGUF file of a hub repository ``--model`` names (models/gguf.py)."""
    parser.add_argument("--gguf-file", default=None, metavar="FILE.gguf",
                        help="with a hub id: read this GGUF file of the repository (dequantized by transformers, "
                             "then packed; needs the 'gguf' extra)")


def engine_policy_options(args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """The policy's and the prefetcher's options (``runtime_options``) with ``--profile`` and
    ``--fast-layers`` among the policy's, checked before any work, as is ``--fetch-or-compute``'s profile."""
    from moe_offload.errors import ConfigError
    from moe_offload.policies import policy_info
    from moe_offload.values import integer, option_defaults

    policy_options, prefetch_options = runtime_options(args)
    if args.fetch_or_compute:  # the profile read and checked now, before the model loads
        from moe_offload.runtime.placement import fetch_or_compute_profile

        fetch_or_compute_profile(args.policy, args.hardware, getattr(args, "split_config", None) is not None)
    elif args.hardware is not None:
        from moe_offload.hardware import resolve_profile

        resolve_profile(args.hardware)
    takes = option_defaults(policy_info(args.policy).policy)
    for flag, option, value in (("--profile", "profile", args.profile), ("--fast-layers", "fast_layers",
                                                                       args.fast_layers)):
        if value is None:
            continue
        if option not in takes:
            raise ConfigError(f"{flag}: policy {args.policy!r} takes no {option} (static-freq and pinned-lru take "
                              "--profile, static-layers --fast-layers)")
        if option in (policy_options or {}):
            raise ConfigError(f"{flag} and --policy-option {args.policy}.{option}=... say the same thing: give one")
        value = _profile(value) if option == "profile" else integer(value, flag, low=0)
        policy_options = {**(policy_options or {}), option: value}
    return policy_options, prefetch_options


def _profile(path) -> str:
    """``--profile``'s trace, read once here so that a bad one is refused before the model loads."""
    from moe_offload.errors import ConfigError, TraceError
    from moe_offload.inputs import check_input
    from moe_offload.trace.format import read_trace

    try:
        read_trace(check_input(path, "profile trace"))
    except TraceError as exc:
        raise ConfigError(f"--profile: {exc}") from None
    return str(path)


def check_prefetch(args: argparse.Namespace) -> None:
    """--prefetch and --prefetch-history of generate and serve, checked before anything loads. 'none' (the
    default, simulate --timed's word too) is no prefetcher: ``args.prefetch`` becomes None. Refused now, not after
    the model has loaded: a prefetcher that reads the future routing (the engine runs live prompts), and one that
    learns from past sequences without a history (the tiny model brings its own)."""
    from moe_offload.errors import ConfigError
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


def run(args: argparse.Namespace) -> int:
    import json

    from moe_offload.models import require_model_stack

    check_prefetch(args)
    require_model_stack("generate")
    from moe_offload.models.gguf import with_gguf_file

    args.model = with_gguf_file(args.model, args.gguf_file)
    from moe_offload.api import load
    from moe_offload.reporting.tables import print_runtime_summary
    from moe_offload.text.sources import chat_prompt

    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.runtime.engine_setup import resolve_device

    from moe_offload import values

    if args.json:
        from moe_offload.runtime.pack_cache import model_files

        check_output(args.json, suffixes=(".json",), what="result record",
                     inputs=[*model_files(args.model), args.split_config, args.prefetch_history])
    values.integer(args.max_new_tokens, "--max-new-tokens", low=1)
    apply_threads(args)
    resolve_device(args.device)
    check_dtype(args)
    if args.split_config:  # a bad file is refused before the model is packed or loaded
        from moe_offload.simulator.split import read_split_config

        read_split_config(args.split_config)
    reconfiguration = online_reconfiguration(args)
    policy_options, prefetch_options = engine_policy_options(args)
    prompt = chat_prompt(args.prompt) if args.chat else args.prompt
    engine = load(args.model, fast_budget=args.fast_budget, host_budget=args.host_budget, policy=args.policy,
                  policy_options=policy_options, prefetch=args.prefetch, prefetch_options=prefetch_options,
                  prefetch_history=args.prefetch_history, device=args.device, expert_dtype=args.expert_dtype, dtype=args.dtype,
                  expert_compute=args.expert_compute,
                  bypass_page_cache=args.bypass_page_cache, matcher=args.matcher,
                  split_config=args.split_config, reconfiguration=reconfiguration, hardware=args.hardware,
                  fetch_or_compute=args.fetch_or_compute)
    with engine:
        # the prompt's length against the context before the prompt is echoed (the engine checks it again)
        engine.check_length(len(engine.tokenizer(prompt)["input_ids"]), args.max_new_tokens)
        sys.stdout.write(prompt)
        sys.stdout.flush()
        result = engine.generate(prompt, max_new_tokens=args.max_new_tokens,
                                 on_text=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        sys.stdout.write("\n\n")
        if args.model == "tiny":  # a first run shows this model's text: say what it is for
            spec = engine.spec
            print(f"note: the bundled tiny model ({spec.num_layers} layers x {spec.num_experts} experts, top-"
                  f"{spec.top_k}, trained for minutes on a CPU) is there to run the offloading end to end on any "
                  "machine; its text is not meant to make sense. The numbers below are what the run shows.")
        print_runtime_summary(result, engine)
        if engine.split is not None and engine.split.reconfigurations:
            records = engine.split.reconfigurations
            applied = [record for record in records if record["applied"]]
            last = "; now " + ", ".join(f"{layer['cache_size']}x{layer['rows']}" for layer in applied[-1]["layers"]) \
                if applied else ""
            print(f"online configuration: reconfigured {len(applied)} of {len(records)} times (tops x rows per layer"
                  f"{last})")
        late, arrived = engine.late_proposals
        if arrived:
            print(f"matcher: {late} of {arrived} proposals arrived after their layer was routed ({late / arrived:.1%})")
    if args.json:  # the run's record, with what it generated
        record = {**result.stats.to_dict(), "prompt": prompt, "prompt_tokens": result.prompt_tokens,
                  "text": result.text, "token_ids": result.token_ids}
        write_atomically(args.json, json.dumps(record, indent=1))
    return 0


def check_dtype(args: argparse.Namespace) -> None:
    """--dtype, --expert-dtype and --expert-compute, before the model is packed or loaded."""
    from moe_offload.errors import ConfigError
    from moe_offload.hardware.choices import COMPUTE_DTYPES, EXPERT_COMPUTE
    from moe_offload.runtime.packing import check_expert_dtype

    check_expert_dtype(args.expert_dtype)
    if args.dtype is not None and args.dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r}: choose from {', '.join(COMPUTE_DTYPES)}")
    if args.expert_compute is not None and args.expert_compute not in EXPERT_COMPUTE:
        raise ConfigError(f"--expert-compute {args.expert_compute!r}: choose from {', '.join(EXPERT_COMPUTE)}")


def online_reconfiguration(args):
    """MoEpic's online loop of --reconfigure-every and --granularity (simulate --timed's options), checked before
    any work; None without --reconfigure-every."""
    from moe_offload.errors import ConfigError
    from moe_offload.simulator.timed import Reconfiguration

    if args.reconfigure_every is None:
        if args.granularity is not None:
            raise ConfigError("--granularity belongs to the online configuration: add --reconfigure-every")
        if args.hardware is not None:
            from moe_offload.hardware import resolve_profile

            resolve_profile(args.hardware)
        return None
    given = {} if args.granularity is None else {"granularity": args.granularity}
    reconfiguration = Reconfiguration(args.reconfigure_every, **given)
    reconfiguration.check()
    if args.hardware is not None:
        from moe_offload.hardware import resolve_profile

        resolve_profile(args.hardware)
    return reconfiguration
