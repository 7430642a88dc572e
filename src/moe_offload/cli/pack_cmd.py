"""`moe-offload pack`: split a checkpoint into non-expert weights and one file per expert (runtime/packing.py)."""

from __future__ import annotations

import argparse

from moe_offload.cli.options import add_gguf_file
from moe_offload.values import format_bytes


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "pack", help="split a checkpoint into non-expert weights and one file of raw expert tensors per layer",
        description="Write the non-expert weights to one file and every layer's routed experts to one file "
                    "of raw tensors with a manifest of offsets and checksums, so that the runtime loads only the non-experts "
                    "at start-up and reads experts on demand (FlashMoE, paper 003). Reports the start-up time.")
    parser.add_argument("model", metavar="MODEL",
                        help="tiny (the bundled model), a checkpoint directory, a hub id ORG/NAME[@REVISION] or a "
                             "GGUF file (dequantized by transformers, then packed; needs the 'gguf' extra)")
    add_gguf_file(parser)
    parser.add_argument("-o", "--output", required=True, metavar="DIR",
                        help="new directory to write (missing or empty; written atomically)")
    parser.add_argument("--expert-dtype", default=None, metavar="float16|bfloat16|int8|int4",
                        help="store the experts in this dtype (int8/int4: group-wise with float16 scales, what the "
                             "runtime moves and holds); default: the checkpoint's")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moe_offload.models import require_model_stack

    require_model_stack("pack")
    from moe_offload.models.gguf import with_gguf_file

    args.model = with_gguf_file(args.model, args.gguf_file)
    from moe_offload.models.tiny import model_directory
    from moe_offload.reporting.progress import progress_bar
    from moe_offload.runtime.packing import check_expert_dtype, pack_model
    from moe_offload.runtime.skeleton import load_skeleton

    from moe_offload.outputs import check_output

    check_expert_dtype(args.expert_dtype)
    check_output(args.output, directory=True, what="packed model")  # before loading anything
    with progress_bar() as bar:
        task = bar.add_task("packing experts", total=None)
        manifest = pack_model(model_directory(args.model), args.output, on_expert=lambda: bar.advance(task),
                              expert_dtype=args.expert_dtype)
    _, _, seconds = load_skeleton(manifest)
    count = len(manifest.experts)
    print(f"wrote {args.output}: {count} {manifest.expert_dtype or manifest.dtype} experts ({manifest.num_layers} "
          f"layers x {manifest.num_experts}), "
          f"{format_bytes(manifest.expert_bytes)} each, {format_bytes(count * manifest.expert_bytes)} in all")
    print(f"start-up (non-expert weights only): {seconds * 1000:.0f} ms")
    return 0
