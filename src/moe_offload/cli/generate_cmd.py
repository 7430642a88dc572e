"""`moe-offload generate`: stream text from an MoE model whose experts are offloaded (runtime/engine.py)."""

from __future__ import annotations

import argparse
import sys

from moe_offload.cli.options import add_runtime, add_split, apply_threads, plan_from_args


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
    add_runtime(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="default 64; a prompt plus N beyond the model's context is refused")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the bundled model's chat format (User: ...\\nAssistant:)")
    add_split(parser, granularity_default=None,
              split_help="run MoEpic's split experts as `moe-offload configure --json` wrote them: per layer, the "
                         "cached top segments and the split ratio, plus a buffer of top-k experts, all within "
                         "--fast-budget; the tokens are the all-resident model's computing with the same split; "
                         "--prefetch moepic takes the configuration's prefetch count per layer; --host-budget adds "
                         "a host tier",
              reconfigure_help="MoEpic's online configurator (paper 004, Algorithm 1): rerun the split configuration "
                               "every TAU tokens from the routing seen so far and resize the running tops between "
                               "two passes (the paper's tau is 5000); starts from --split-config, or from the uniform "
                               "allocation with split ratio 0.5 on --fast-budget less the buffer of top-k experts")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write the run's result record, with the prompt, the text and the token ids, as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from moe_offload.models import require_model_stack
    from moe_offload.models.gguf import with_gguf_file

    args.model = with_gguf_file(args.model, args.gguf_file)
    plan = plan_from_args(args, split_config=args.split_config, reconfigure_every=args.reconfigure_every,
                          granularity=args.granularity)
    require_model_stack("generate")
    from moe_offload.reporting.tables import print_runtime_summary
    from moe_offload.runtime.engine import OffloadEngine
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
    if args.split_config:  # a bad file is refused before the model is packed or loaded
        from moe_offload.simulator.split import read_split_config

        read_split_config(args.split_config)
    prompt = chat_prompt(args.prompt) if args.chat else args.prompt
    with OffloadEngine(plan) as engine:
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
