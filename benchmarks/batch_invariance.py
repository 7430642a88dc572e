"""How often a batched request gets the tokens and logits it gets alone, on this device.

    python benchmarks/batch_invariance.py [--device cpu|cuda] [--max-tokens 24] [--budget 100%]
        [--batch-math exact,fast] [--json FILE]

Each of 16 prompts is generated alone (transformers' generate through the offloaded engine, greedy), then all
16 together by the continuous-batching scheduler, which packs them into each forward pass. Per batch math:
how many requests have the same tokens, how many of the decoding steps before a request's first different
token have bit-identical logits, the largest logit difference over those steps, and where tokens first
differ. On CPU float32 with exact batch math every request must be identical (the tests assert it); on a
GPU this measures what the kernels do (the README's "Serving" section).
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = [
    "User: What is a cache?\nAssistant:", "User: hi\nAssistant:", "def add(a, b):",
    "User: Tell me about the history of Rome, its emperors and its roads.\nAssistant:",
    "The quick brown fox", "User: How do I sort a list in Python?\nAssistant:", "import os\n\n",
    "User: Why is the sky blue?\nAssistant:", "class Stack:\n    def __init__(self):",
    "User: Write a poem about the sea.\nAssistant:", "User: What is 12 times 7?\nAssistant:",
    "for i in range(10):", "User: Explain continuous batching to a child.\nAssistant:",
    "User: Translate 'good morning' into French.\nAssistant:", "# A function that reverses a string\n",
    "User: List three prime numbers.\nAssistant:",
]


def compare(alone, batched) -> dict:
    import torch

    same_tokens, equal_steps, steps, worst, first_difference = 0, 0, 0, 0.0, []
    for a, b in zip(alone, batched):
        diverge = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if diverge is None and len(a.token_ids) == len(b.token_ids):
            same_tokens += 1
        else:
            first_difference.append(diverge if diverge is not None else min(len(a.token_ids), len(b.token_ids)))
        end = diverge + 1 if diverge is not None else len(a.logits)
        for x, y in zip(a.logits[:end], b.logits[:end]):
            steps += 1
            equal_steps += bool(torch.equal(x, y))
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return {"requests": len(alone), "same_tokens": same_tokens, "steps_compared": steps,
            "bit_identical_steps": equal_steps, "max_abs_logit_difference": worst,
            "first_token_difference_at": first_difference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-tokens", default="24")
    parser.add_argument("--budget", default="100%")
    parser.add_argument("--batch-math", default="exact,fast")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    from moe_offload import values
    from moe_offload.api import load
    from moe_offload.outputs import check_output, write_atomically

    max_tokens = values.integer(args.max_tokens, "--max-tokens", low=1)
    if args.json:
        check_output(args.json, suffixes=(".json",), what="benchmark result")
    rows = []
    for math in args.batch_math.split(","):
        with load("tiny", fast_budget=args.budget, device=args.device, max_batch=len(PROMPTS),
                  batch_math=math) as engine:
            alone = [engine.generate(p, max_new_tokens=max_tokens, return_logits=True) for p in PROMPTS]
            batched = engine.generate_batch(PROMPTS, max_new_tokens=max_tokens, return_logits=True)
            row = {"batch_math": math, "device": str(engine.device), "dtype": str(engine.compute_dtype),
                   **compare(alone, batched)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        write_atomically(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
