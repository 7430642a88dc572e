"""What reading the learned policy's network on a grid costs in hits: the policy (policies/learned.py) against
the same network scored on its exact inputs [1/r, f / max f] at every eviction, on the same traces and sizes.

    python benchmarks/learned_grid.py                       # the bundled OLMoE trace and the shared ones
    python benchmarks/learned_grid.py --synthetic-tokens 20000   # and a 48 x 128 top-8 Zipf trace (7.7M requests)

The exact scoring is the policy's own code with one change, here: where the policy reads table[row, column],
ExactLearned runs the network on the residents' exact features, one batched forward pass per rescoring, as
the policy did before it read a grid. Both replay as Python objects (the exact one has no kernel), so the
synthetic trace takes minutes at each size. Printed: each hit rate and their difference in points.
"""

from __future__ import annotations

import argparse
import heapq
import time
from pathlib import Path

import numpy as np

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.policies import POLICIES, PolicyInfo
from moe_offload.policies.learned import LearnedEviction
from moe_offload.policies.learned_model import features
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.format import read_trace
from moe_offload.trace.importers import import_routes_json, import_topk_jsonl
from moe_offload.trace.synthetic import zipf_trace

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
QWEN_FILES = ("cooking_1", "history_1", "ml_moe_1", "history_2", "ml_moe_2", "ml_moe_3")
FRACTIONS = (0.125, 0.25, 0.5)


class ExactLearned(LearnedEviction):
    """The learned policy with every score computed by the network on the exact features."""

    name = "learned-exact"
    replay_kernel = None

    def _exact(self, slots: np.ndarray, token: int) -> list:
        last = self._token_np[slots]
        recency = np.where(last >= 0, np.maximum(token - last + 1, 1), 0)
        x = features(recency, self._freq_np[slots], self._max_freq)
        return (-self.model.forward(x, self._network_np[slots]).astype(np.float64)).tolist()

    def _rescore_all(self, token: int) -> None:
        slots = np.flatnonzero(self._resident)
        negs, slot_list = self._exact(slots, token), slots.tolist()
        for slot, value in zip(slot_list, negs):
            self._neg[slot] = value
        self._heap = list(zip(negs, [self._clock[s] for s in slot_list], slot_list))
        heapq.heapify(self._heap)
        self._scored_token, self._scored_max = token, self._max_freq
        self._dirty.clear()

    def _rescore_dirty(self, token: int) -> None:
        slots = np.array(sorted(self._dirty), dtype=np.int64)
        for slot, value in zip(slots.tolist(), self._exact(slots, token)):
            self._neg[slot] = value
            heapq.heappush(self._heap, (value, self._clock[slot], slot))
        self._dirty.clear()


def traces(synthetic_tokens: int) -> dict[str, ReplayInput]:
    out = {"OLMoE (bundled)": read_trace(DEFAULT_TRACE)}
    if (SHARED_TRACES / "qwen1.5-moe-a2.7b").is_dir():
        out["Qwen1.5-MoE"] = import_routes_json(
            [SHARED_TRACES / "qwen1.5-moe-a2.7b" / f"{name}.json" for name in QWEN_FILES], num_experts=60)
        out["gpt-oss-120b"] = import_topk_jsonl(SHARED_TRACES / "gpt-oss-120b" / "chat_149_tokens.jsonl",
                                                num_experts=128)
    if synthetic_tokens:
        out[f"Zipf 48x128 top-8, {synthetic_tokens:,} tokens"] = zipf_trace(
            48, 128, 8, synthetic_tokens, a=1.2, b=0.0, seed=0, shuffle=True)
    return {name: ReplayInput.of(trace, name=name) for name, trace in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic-tokens", type=int, default=0,
                        help="add a 48 x 128 top-8 Zipf trace (a = 1.2) of this many tokens")
    args = parser.parse_args()
    POLICIES[ExactLearned.name] = PolicyInfo(ExactLearned.name, ExactLearned)
    inputs = traces(args.synthetic_tokens)  # a bad length ends here, before any replay
    print("| trace | cache | grid (the policy) | exact inputs | grid - exact |")
    print("|---|---|---|---|---|")
    for name, data in inputs.items():
        slots = data.spec.num_layers * data.spec.num_experts
        for fraction in FRACTIONS:
            size = max(data.spec.top_k, round(fraction * slots))
            start = time.perf_counter()
            grid = replay(data, "learned", size).hit_rate
            exact = replay(data, ExactLearned.name, size).hit_rate
            print(f"| {name} | {size:,} ({fraction:.1%}) | {grid:.4%} | {exact:.4%} | {(grid - exact) * 100:+.3f} "
                  f"points |  ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
