"""How often a batched request gets the tokens and logits it gets alone, on this device.

    python benchmarks/batch_invariance.py [--device cpu|cuda] [--max-tokens 24] [--budget 100%]
        [--batch-math exact,fast] [--timing] [--threads N] [--json FILE]

Each of 16 prompts is generated alone (transformers' generate through the offloaded engine, greedy), then all
16 together by the continuous-batching scheduler, which packs them into each forward pass. Per batch math:
how many requests have the same tokens, how many of the decoding steps before a request's first different
token have bit-identical logits, the largest logit difference over those steps, and where tokens first
differ. On CPU float32 with exact batch math every request must be identical (the tests assert it); on a
GPU this measures what the kernels do (the README's "Serving" section).

``--timing``: where a pass's time goes. Three more rounds of the 16 prompts batched and 4 of them alone; per
batch math, the best round's mean wall time of a forward pass in which all 16 requests decode one token,
split into the model's linear layers and routers (``PackedPass.linear``), attention (per request), the
experts function (of it, the experts' products: ``PackedPass.blocks`` in exact batch math), the LM head,
and the rest (norms, RoPE, residuals, hooks, the runner); and a generated token's mean wall time when its
request runs alone (its prompt's pass included), 16 of which the pass replaces. And prefill: the best of
three passes that carry 16 ShareGPT first turns (serve_load.py's first 16, chat format) at once, against
the same prompts' passes one at a time (each prompt's first token). ``--threads N`` sets PyTorch's threads
for the run (default: PyTorch's own choice).
"""

from __future__ import annotations

import argparse
import json
import time

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


class PassTimer:
    """Wall time of the batching scheduler's all-decode passes of 16 requests, and of the parts named in the
    module docstring inside them (functions wrapped with timers before the engine is made)."""

    PARTS = ("linear", "attention", "experts", "products", "lm_head")

    def __init__(self):
        from moe_offload.models import experts
        from moe_offload.runtime import batching, packed

        self.passes, self.seconds, self.parts, self.on = 0, 0.0, dict.fromkeys(self.PARTS, 0.0), False
        self._wrap(packed.PackedPass, "linear", "linear")
        self._wrap(packed.PackedPass, "blocks", "products")
        self._wrap(packed.PackedPass, "last_logits", "lm_head")
        self._wrap(packed, "segmented_attention", "attention")
        self._wrap(experts, "experts_forward", "experts")
        iteration = batching.BatchScheduler._iteration

        def timed_iteration(scheduler, batch):
            counted = self.on and len(batch) == len(PROMPTS) and all(r.prefilled for r in batch)
            started = time.perf_counter()
            iteration(scheduler, batch)
            if counted:
                self.passes += 1
                self.seconds += time.perf_counter() - started

        batching.BatchScheduler._iteration = timed_iteration

    def _wrap(self, owner, name, part):
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.on:
                    self.parts[part] += time.perf_counter() - started

        setattr(owner, name, timed)

    def reset(self):
        self.passes, self.seconds, self.parts = 0, 0.0, dict.fromkeys(self.PARTS, 0.0)

    def per_pass_ms(self) -> dict:
        parts = {name: seconds / self.passes * 1000 for name, seconds in self.parts.items()}
        total = self.seconds / self.passes * 1000
        rest = total - parts["linear"] - parts["attention"] - parts["experts"] - parts["lm_head"]
        return {"decode_pass_ms": total, **{f"{name}_ms": value for name, value in parts.items()}, "rest_ms": rest}


def timing(engine, timer: PassTimer, max_tokens: int) -> dict:
    best = None
    for _ in range(3):
        timer.reset()
        timer.on = True
        engine.generate_batch(PROMPTS, max_new_tokens=max_tokens)
        timer.on = False
        if timer.passes and (best is None or timer.seconds / timer.passes < best["decode_pass_ms"] / 1000):
            best = timer.per_pass_ms()
    started = time.perf_counter()
    tokens = sum(len(engine.generate(prompt, max_new_tokens=max_tokens).token_ids) for prompt in PROMPTS[:4])
    alone = (time.perf_counter() - started) / tokens * 1000  # prompts' prefill included, as in a served request
    return {**best, "alone_token_ms": alone, "decode_pass_over_16_alone_tokens": 16 * alone / best["decode_pass_ms"],
            **prefill(engine)}


def prefill(engine) -> dict:
    """The best of three rounds: 16 ShareGPT first turns in one pass, and the same prompts one pass each."""
    from serve_load import sharegpt_first_turns

    prompts = [f"User: {question}\nAssistant:" for question in sharegpt_first_turns(16)]
    together = alone = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        engine.generate_batch(prompts, max_new_tokens=1)
        together = min(together, time.perf_counter() - started)
        started = time.perf_counter()
        for prompt in prompts:
            engine.generate_batch([prompt], max_new_tokens=1)
        alone = min(alone, time.perf_counter() - started)
    return {"prefill_16_prompts_ms": together * 1000, "prefill_one_at_a_time_ms": alone * 1000,
            "prompt_tokens_mean": sum(len(engine.scheduler.encode(p)) for p in prompts) / len(prompts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-tokens", default="24")
    parser.add_argument("--budget", default="100%")
    parser.add_argument("--batch-math", default="exact,fast")
    parser.add_argument("--timing", action="store_true", help="also: where a 16-request decoding pass's time goes")
    parser.add_argument("--threads", default=None, help="PyTorch threads (default: PyTorch's choice)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    from moe_offload import values
    from moe_offload.api import load
    from moe_offload.outputs import check_output, write_atomically

    max_tokens = values.integer(args.max_tokens, "--max-tokens", low=1)
    if args.threads is not None:
        import torch

        torch.set_num_threads(values.integer(args.threads, "--threads", low=1))
    timer = PassTimer() if args.timing else None  # before any engine: it wraps what the engine registers
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
            if timer is not None:
                row.update(timing(engine, timer, max_tokens))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        write_atomically(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
