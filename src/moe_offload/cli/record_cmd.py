"""`moe-offload record`: greedy generation with a real model, writing a routing trace (models/recorder.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_offload.cli.options import add_gguf_file


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "record",
        help="run a real MoE model on prompts and record a routing trace with full router probabilities",
        description="Generate greedily with a transformers MoE model (the bundled 'tiny' or a local checkpoint "
                    "directory of Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE or DeepSeek-V2/V3) and write, per token, "
                    "the selected experts and weights, the full router distribution of every layer, the "
                    "token's input embedding and the next layer's gate prediction (for the last layer: layer 0 "
                    "of the next token).")
    parser.add_argument("--model", default="tiny", metavar="tiny|DIR|ORG/NAME[@REV]|FILE.gguf",
                        help="model: tiny (the bundled one, the default), a checkpoint directory, a hub id or a "
                             "GGUF file")
    add_gguf_file(parser)
    parser.add_argument("--prompts", default="sharegpt", metavar="SOURCES",
                        help="comma-separated prompt sources: sharegpt, humaneval, or files with one prompt per "
                             "line (or .jsonl with 'prompt'); default: sharegpt")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts from each source")
    parser.add_argument("--skip", type=int, default=0, metavar="N",
                        help="skip the first N prompts of each source (e.g. a history on other prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts per batch (default 8)")
    parser.add_argument("-o", "--output", required=True, metavar="TRACE", help="trace file to write (.parquet)")
    parser.add_argument("--texts", metavar="FILE.jsonl", default=None,
                        help="also write each prompt's source and generated text as JSON Lines")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from moe_offload.models.recorder import record
    from moe_offload.models.tiny import load
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.reporting.progress import progress_bar
    from moe_offload.text.prompts import BUILTIN_SOURCES, load_prompts
    from moe_offload.trace.format import write_trace

    from moe_offload.models.gguf import with_gguf_file
    from moe_offload.runtime.pack_cache import model_files

    args.model = with_gguf_file(args.model, args.gguf_file)

    prompt_files = [name.strip() for name in args.prompts.split(",") if name.strip() not in BUILTIN_SOURCES]
    prompt_files += model_files(args.model)  # inputs too: no output may overwrite the model
    check_output(args.output, inputs=prompt_files, what="trace")
    if args.texts:
        check_output(args.texts, inputs=prompt_files + [args.output], what="texts file")
    prompts = load_prompts(args.prompts, args.limit, args.skip)
    model, adapter, tokenizer = load(args.model)
    from moe_offload.models.hub import hub_id

    name = "moe-offload/tiny-mixtral" if args.model == "tiny" else \
        args.model if hub_id(args.model) is not None else Path(args.model).resolve().name
    with progress_bar() as bar:
        task = bar.add_task(f"recording {len(prompts)} prompts", total=len(prompts))
        recording = record(model, adapter, tokenizer, prompts, model_name=name, max_new_tokens=args.max_new_tokens,
                           batch_size=args.batch_size,
                           prompt_source=args.prompts + (f" after the first {args.skip} of each" if args.skip else ""),
                           on_batch=lambda n: bar.advance(task, n))
    path = write_trace(recording.trace, args.output)
    trace = recording.trace
    print(f"wrote {path}: {trace.num_tokens} tokens of {trace.num_requests} requests, "
          f"{trace.meta.num_layers} layers x {trace.meta.num_experts} experts, top-{trace.meta.top_k}, "
          f"with probs, embedding, gate_prediction and next_token_gate_prediction "
          f"({path.stat().st_size / 1e6:.2f} MB)")
    if args.texts:
        write_atomically(args.texts, "".join(
            json.dumps({"source": prompt.source, "prompt": prompt.text, "generated": text}) + "\n"
            for prompt, text in zip(prompts, recording.texts)))
        print(f"wrote {args.texts}")
    return 0
