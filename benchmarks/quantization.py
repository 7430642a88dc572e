"""What quantized experts cost and save on the bundled tiny Mixtral: per expert dtype and fast budget, the bytes
moved into the fast tier per token, the hit rate and TPOT of the offloaded runtime, and against the float16
experts the held-out perplexity and the top-1 agreement.

    python benchmarks/quantization.py [--dtypes float16,int8,int4] [--budgets 25] [--tokens 24] [--prompts 2]
        [--windows 8] [--computes float32,bfloat16] [--threads N] [--device cpu|cuda] [--json FILE]

The table of the docs page: ``--tokens 64 --prompts 4 --windows 32 --computes float32,bfloat16 --threads 1``.
``--computes``: the fast tier's compute dtype, each optionally with the quantized experts' form
(``bfloat16:per-use``; default auto, runtime/expert_forms.py), one engine per entry.

- Runtime: a fresh engine per (dtype, budget), LRU, no prefetch, greedy, on ShareGPT first turns as chat
  prompts; bytes per token are the bytes put on the links into the fast tier over the generated tokens; TPOT
  the mean of each prompt's. Budgets are shares of all experts in the compute dtype, so a share is the same
  memory for every expert dtype and more quantized experts fit in it.
- Quality, per expert dtype and compute, on the all-resident model computing as the runtime does (every expert
  of the pack resident in the fast tier's form, the model in the compute dtype: ResidentExperts), against the
  float16 checkpoint computed in float32: perplexity on ``--windows`` windows of 256 tokens of the held-out
  code and English the tiny model was not trained on (text/sources.is_held_out), and top-1 agreement: the
  float16 model generates ``--tokens`` tokens greedily per prompt, each model reads that same text, and the
  share of positions where both pick the same next token.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys


class ResidentExperts:
    """Every expert of a pack resident as the runtime's fast tier holds it in ``compute`` ("DTYPE[:FORM]",
    runtime/expert_forms.py): an expert source for models/experts.py, so that a model computes with the
    runtime's own arithmetic (the all-resident engine's) on whole windows of text."""

    def __init__(self, packed_dir, compute: str):
        import torch

        from moe_offload.runtime.expert_forms import expert_form
        from moe_offload.runtime.packing import read_manifest
        from moe_offload.runtime.storage import ExpertStore

        dtype_name, _, form_name = compute.partition(":")
        dtype = getattr(torch, dtype_name)
        manifest = read_manifest(packed_dir)
        form = expert_form(form_name or None, manifest, torch.device("cpu"), dtype)
        self.form_name = form.name if form is not None else "float"
        store = ExpertStore(manifest)
        self.weights = {}
        for index, (layer, expert) in enumerate(sorted(manifest.experts)):
            if form is None:
                tensors = store.read_tensors(layer, expert)
                self.weights[layer, expert] = {name: weight.to(dtype) for name, weight in tensors.items()}
                continue
            stored = torch.empty(manifest.expert_bytes, dtype=torch.uint8)
            array = stored.numpy()
            store.read(layer, expert, lambda start, end: memoryview(array[start:end]))
            slot = torch.empty(form.slot_elements, dtype=form.slot_dtype)
            form.convert(stored, slot)
            self.weights[layer, expert] = form.tensors(slot, index)
        store.close()

    def layer_experts(self, layer, experts, tokens):
        for expert in experts:
            yield expert, self.weights[layer, expert]


def resident_model(reference, adapter_class, expert_dtype: str, compute: str):
    """A copy of the float32 ``reference`` in the compute dtype whose experts are the ``expert_dtype`` pack's,
    computed as the runtime computes them in ``compute`` (ResidentExperts); and the form's name."""
    import torch

    from moe_offload.models.experts import use_project_experts
    from moe_offload.runtime.pack_cache import packed_directory

    experts = ResidentExperts(packed_directory("tiny", expert_dtype=expert_dtype), compute)
    model = copy.deepcopy(reference).to(getattr(torch, compute.partition(":")[0]))
    use_project_experts(adapter_class(model), experts)
    return model.eval(), experts.form_name


def held_out_windows(count: int):
    """``count`` windows of held-out code and as many of held-out English (the training recipe's windows)."""
    import numpy as np
    from tokenizers import Tokenizer

    from moe_offload.bundled import TINY_MODEL_DIR
    from moe_offload.training.tiny_model import TinyRecipe, load_corpus, windows

    recipe = TinyRecipe()
    tokenizer = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
    corpus = load_corpus(recipe.seed)
    return np.concatenate([windows(tokenizer, docs, count, recipe) for docs in corpus.held_out.values()])


def top1_agreement(model, reference_sequences, prompt_lengths) -> float:
    import torch

    same = total = 0
    with torch.no_grad():
        for sequence, start in zip(reference_sequences, prompt_lengths):
            ids = torch.tensor([sequence])
            picks = model(input_ids=ids).logits[0, start - 1:-1].argmax(-1)
            same += int((picks == ids[0, start:]).sum())
            total += len(sequence) - start
    return same / total


def runtime_row(expert_dtype: str, budget: str, compute: str, prompts, tokens: int, device: str) -> dict:
    import moe_offload

    dtype, _, form = compute.partition(":")
    with moe_offload.load("tiny", fast_budget=f"{budget}%", expert_dtype=expert_dtype, device=device, dtype=dtype,
                          expert_compute=form or None) as engine:
        moved = generated = 0
        tpots, hits, accesses = [], 0, 0
        for prompt in prompts:
            result = engine.generate(prompt, max_new_tokens=tokens)
            stats = result.stats
            moved += sum((stats.bytes_per_link or {}).values())
            generated += len(result.token_ids)
            tpots.append(stats.tpot_seconds)
            hits, accesses = hits + stats.hits, accesses + stats.accesses
        form = engine.expert_form.name if engine.expert_form is not None else "float"
        return {"expert_dtype": expert_dtype, "budget": budget, "compute": f"{dtype}, {form}",
                "experts_held": engine.tiers[0].pool.slots,
                "expert_bytes": engine.manifest.expert_bytes, "bytes_per_token": moved / generated,
                "hit_rate": hits / accesses, "tpot_ms": 1000 * sum(tpots) / len(tpots)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float16,int8,int4")
    parser.add_argument("--budgets", default="25", help="fast budgets in %% of all experts (default 25)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--windows", type=int, default=8, help="held-out windows of 256 tokens per kind")
    parser.add_argument("--computes", default="float32",
                        help="compute dtypes of the fast tier, each optionally :FORM (default float32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default torch's; 1 steadies TPOT on a shared machine)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from moe_offload.bundled import TINY_MODEL_DIR
    from moe_offload.models.adapters import load_model
    from moe_offload.text.sources import chat_prompt, sharegpt_prompts
    from moe_offload.training.tiny_model import perplexity

    dtypes = args.dtypes.split(",")
    prompts = [chat_prompt(text) for text in sharegpt_prompts()[-args.prompts:]]  # the recorded traces use the first
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    reference, adapter = load_model(TINY_MODEL_DIR)
    float16, _ = resident_model(reference, adapter.__class__, "float16", "float32")  # the checkpoint as it is
    sequences, lengths = [], []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = float16.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                   do_sample=False, pad_token_id=0)
        sequences.append(out[0].tolist())
        lengths.append(ids.shape[1])
    batch = held_out_windows(args.windows)
    base = perplexity(float16, batch)
    quality = {}
    for compute in args.computes.split(","):
        for expert_dtype in dtypes:
            model, _ = resident_model(reference, adapter.__class__, expert_dtype, compute)
            value = perplexity(model, batch)
            quality[expert_dtype, compute] = {"perplexity": value, "perplexity_delta": value - base,
                                              "top1_agreement": top1_agreement(model, sequences, lengths)}
    rows = [{**runtime_row(d, b, c, prompts, args.tokens, args.device), **quality[d, c]}
            for b in args.budgets.split(",") for c in args.computes.split(",") for d in dtypes]
    print(f"tiny Mixtral, {args.device} ({torch.get_num_threads()} threads), {len(prompts)} prompts x {args.tokens} "
          f"tokens, LRU; perplexity on "
          f"{len(batch)} held-out windows (float16: {base:.3f})")
    print("| experts | budget | compute | experts held | bytes/token | hit rate | TPOT | perplexity delta | "
          "top-1 agreement |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['expert_dtype']} | {row['budget']}% | {row['compute']} | {row['experts_held']} | "
              f"{row['bytes_per_token'] / 2**20:.2f} MiB | {row['hit_rate']:.1%} | {row['tpot_ms']:.1f} ms | "
              f"{row['perplexity_delta']:+.4f} | {row['top1_agreement']:.1%} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"float16_perplexity": base, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
