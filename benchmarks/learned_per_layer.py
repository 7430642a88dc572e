"""FlashMoE's learned eviction (paper 003): one network shared by every MoE layer against one network per layer
(the paper's "per-layer ML cache FFN"), trained alike and measured on rows neither saw.

    python benchmarks/learned_per_layer.py                       # quick: OLMoE only, capped training (< 1 min)
    python benchmarks/learned_per_layer.py --full [--json FILE]  # the shipped model's settings, OLMoE and Qwen

Workloads (training rows -> held-out rows):

* OLMoE-1B-7B, the bundled trace (converted from ../shared/traces/olmoe-1b-7b/decode_299.jsonl): rows 0:150
  -> rows 150:299, the split of the shipped model (src/moe_offload/data/NOTICE.md).
* Qwen1.5-MoE-A2.7B, ../shared/traces/qwen1.5-moe-a2.7b (--full, or --qwen): the manifest's same-domain split,
  ml_moe_1 + ml_moe_2 -> ml_moe_3. A per-layer model has one network per layer of its own model (24 here, 16 for
  OLMoE), so each model trains its own pair.

Both variants are trained by moe_offload.training.train_learned_eviction with the same rows, cache sizes (6.25%,
12.5%, 25%, 50% of the experts), target (log-distance), seed and thread count; only ``per_layer`` differs. On
the held-out rows, at 12.5%, 25% and 50% of the experts:

* the target's loss and accuracy: Belady's OPT is replayed on the held-out rows (training.collect_belady_samples,
  as for training) and every resident at each eviction is scored. MSE is against the log-distance target; pairs
  ordered is the share of resident pairs of one eviction, with different next uses, that the scores order as
  those next uses (training.eviction_samples.pair_order_accuracy); victim = Belady's is the share of evictions
  whose highest-scored resident is as far from reuse as Belady's victim;
* hit rate of each learned model in the replay simulator, beside LRU and Belady.

--full trains as the shipped model was (200 epochs at most, patience 20, 50,000 samples per size, no time limit)
and takes about 10 minutes on a loaded 2-core CPU; the quick default caps training at 15 epochs and 5,000
samples per size, enough to check the pipeline, not to choose between the variants.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.outputs import write_atomically
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace import read_trace
from moe_offload.trace.format import Trace
from moe_offload.trace.importers import import_routes_json
from moe_offload.training import TrainingSource, collect_belady_samples, train_learned_eviction
from moe_offload.training.eviction_samples import agreement, pair_order_accuracy

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
QWEN_FOLDER = SHARED_TRACES / "qwen1.5-moe-a2.7b"
TRAINING_FRACTIONS = (0.0625, 0.125, 0.25, 0.5)  # train-eviction's default cache sizes
EVALUATION_FRACTIONS = (0.125, 0.25, 0.5)
OLMOE_TRAINING_ROWS = 150
QWEN_SPLIT = (("ml_moe_1", "ml_moe_2"), ("ml_moe_3",))  # manifest.json: same_domain_moe
VARIANTS = (("shared", False), ("per-layer", True))


def sizes(trace: Trace, fractions) -> list[int]:
    return [max(trace.meta.top_k, round(f * trace.meta.num_expert_slots)) for f in fractions]


def workloads(with_qwen: bool) -> list[tuple[str, Trace, Trace]]:
    """(name, training rows, held-out rows) of each workload."""
    olmoe = read_trace(DEFAULT_TRACE)
    out = [("OLMoE rows 0:150 -> 150:299", olmoe.select(slice(0, OLMOE_TRAINING_ROWS)),
            olmoe.select(slice(OLMOE_TRAINING_ROWS, None)))]
    if with_qwen:
        if not QWEN_FOLDER.is_dir():
            print(f"skipped Qwen1.5-MoE: {QWEN_FOLDER} is not here")
        else:
            train, test = ([QWEN_FOLDER / f"{name}.json" for name in names] for names in QWEN_SPLIT)
            out.append((f"Qwen1.5-MoE {'+'.join(QWEN_SPLIT[0])} -> {QWEN_SPLIT[1][0]}", import_routes_json(train),
                        import_routes_json(test)))
    return out


def held_out_scores(model, trace: Trace, cache_size: int) -> dict:
    """The target's MSE, pairs ordered and victim agreement of ``model`` at Belady's evictions on all of
    ``trace``'s rows."""
    samples = collect_belady_samples(TrainingSource(trace, (0, trace.num_tokens), [cache_size]))
    scores = model.forward(samples.inputs(), samples.layer).astype(np.float64)
    return {"target_mse": float(np.mean((scores - samples.targets("log-distance")) ** 2)),
            "pairs_ordered": pair_order_accuracy(samples, scores), "belady_agreement": agreement(samples, scores)}


def run(full: bool, with_qwen: bool, threads: int) -> list[dict]:
    training = dict(epochs=200, patience=20, max_samples=50_000) if full else dict(epochs=15, patience=5,
                                                                                    max_samples=5_000)
    rows = []
    for name, train, test in workloads(with_qwen):
        models = {}
        for variant, per_layer in VARIANTS:
            began = time.perf_counter()
            result = train_learned_eviction([TrainingSource(train, (0, train.num_tokens),
                                                            sizes(train, TRAINING_FRACTIONS))],
                                            per_layer=per_layer, seed=0, threads=threads, time_limit=None,
                                            **training)
            models[variant] = result.model
            print(f"{name}: {variant} trained in {time.perf_counter() - began:.0f} s "
                  f"(validation MSE {result.training['validation_loss']:.4f})", flush=True)
        data = ReplayInput.of(test)
        for size in sizes(test, EVALUATION_FRACTIONS):
            row = {"workload": name, "cache_size": size, "share": size / test.meta.num_expert_slots}
            for variant, model in models.items():
                result = replay(data, "learned", size, options={"model": model})
                row[variant] = {**held_out_scores(model, test, size), "hit_rate": result.hits / result.accesses}
            for policy in ("lru", "belady"):
                result = replay(data, policy, size)
                row[policy] = {"hit_rate": result.hits / result.accesses}
            rows.append(row)
            print(f"{name}: {size} experts done", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| held-out rows | cache | target MSE shared / per-layer | pairs ordered shared / per-layer "
             "| victim = Belady's shared / per-layer | hit rate shared | per-layer | LRU | Belady |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        shared, per_layer = row["shared"], row["per-layer"]
        lines.append(f"| {row['workload']} | {row['cache_size']} ({row['share']:.1%}) "
                     f"| {shared['target_mse']:.3f} / {per_layer['target_mse']:.3f} "
                     f"| {shared['pairs_ordered']:.1%} / {per_layer['pairs_ordered']:.1%} "
                     f"| {shared['belady_agreement']:.1%} / {per_layer['belady_agreement']:.1%} "
                     f"| {shared['hit_rate']:.1%} | {per_layer['hit_rate']:.1%} | {row['lru']['hit_rate']:.1%} "
                     f"| {row['belady']['hit_rate']:.1%} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the shipped model's training settings, OLMoE and Qwen")
    parser.add_argument("--qwen", action="store_true", help="the Qwen workload too (implied by --full)")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads (default 1: repeatable)")
    parser.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = parser.parse_args()
    began = time.perf_counter()
    rows = run(args.full, args.full or args.qwen, args.threads)
    print(table(rows))
    print(f"{time.perf_counter() - began:.0f} s")
    if args.json:
        write_atomically(args.json, json.dumps({"full": args.full, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
