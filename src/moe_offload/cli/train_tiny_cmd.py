"""`moe-offload train-tiny`: train the bundled tiny Mixtral from scratch (see training/tiny_model.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from moe_offload.errors import ConfigError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-tiny",
        help="train the bundled tiny Mixtral MoE model from scratch on CPU",
        description="Train a byte-level BPE tokenizer and a transformers MixtralForCausalLM (8 layers x 8 experts, "
                    "top-2) on the CPython standard library sources and the ShareGPT conversations installed on "
                    "this machine, with a fixed seed; write float16 safetensors, the tokenizer, a training report "
                    "(held-out perplexity on code and English, routing statistics against a random-router "
                    "control) and the loss curve. The defaults reproduce the checkpoint that ships in the package "
                    "(about 40 minutes on 2 cores).")
    parser.add_argument("-o", "--output", metavar="DIR", required=True, help="directory to write the model to")
    parser.add_argument("--steps", metavar="N", type=int, default=None, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--threads", metavar="N", type=int, default=2,
                        help="PyTorch CPU threads; bit-exact reproduction needs the same count (default: 2)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moe_offload.models import require_model_stack

    require_model_stack("train-tiny")
    import torch

    from moe_offload.models import quiet_transformers

    from moe_offload.reporting.progress import progress_bar
    from moe_offload.training.tiny_model import TinyRecipe, train_tiny

    recipe = TinyRecipe(seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError("--steps must be at least 1")
        recipe = replace(recipe, steps=args.steps, warmup_steps=min(recipe.warmup_steps, max(1, args.steps // 10)))
    if args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    torch.set_num_threads(args.threads)
    quiet_transformers()

    with progress_bar() as bar:
        task = bar.add_task("preparing", total=recipe.steps)

        def on_stage(stage: str) -> None:
            bar.update(task, description=stage)
            bar.console.print(f"[dim]{stage}[/dim]") if not bar.disable else print(stage, flush=True)

        def on_step(step: int, loss: float) -> None:
            bar.update(task, completed=step + 1, description=f"training, loss {loss:.3f}")
            if bar.disable and (step + 1) % 50 == 0:
                print(f"step {step + 1}/{recipe.steps}: loss {loss:.4f}", flush=True)

        report = train_tiny(args.output, recipe, on_step=on_step, on_stage=on_stage)

    metrics = report["metrics"]
    corpus = report["corpus"]
    print(f"wrote {args.output}: {report['parameters'] / 1e6:.1f}M parameters, {report['tokens_trained'] / 1e6:.1f}M "
          f"tokens in {report['train_seconds'] / 60:.1f} min")
    print(f"ShareGPT: {corpus['sharegpt_complete_conversations']} complete conversations recovered from the "
          f"truncated file; {corpus['code_documents']} standard-library files")
    print("held-out perplexity: " + ", ".join(f"{k} {v:.1f}" for k, v in metrics["held_out_perplexity"].items())
          + " (random routers: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                              metrics["held_out_perplexity_random_router"].items()) + ")")
    for name in ("routing_trained", "routing_random_router", "routing_uniform"):
        stats = metrics[name]
        print(f"{name.replace('_', ' ')}: next-token expert reuse {stats['next_token_expert_reuse']:.3f}, "
              f"code/English usage distance {stats['code_english_usage_tv_distance']:.3f}")
    return 0
