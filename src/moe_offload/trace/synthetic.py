"""Synthetic routing traces: the Zipf traces and the adversarial sequences of the layered-paging paper.

Paper 001 (layered paging) uses three kinds of made-up request sequences:

* section 5.1: i.i.d. tokens whose experts follow a Zipf law inside each layer, ``p_j ~ 1 / (j + b)^a``
  for the j-th expert (j = 1..J) -> :func:`zipf_trace`;
* Theorem 3.3: all ``k + 1`` pages requested cyclically, the worst case of LRU -> :func:`cyclic_trace`;
* Theorem 3.1: one layer cycles through its experts while every other layer repeats one expert, the worst
  case of a cache split among layers -> :func:`fixed_partition_trace`.

The paper numbers experts and rounds from 1; here both start at 0, so "expert ``i mod n``" in round ``i``.
None of these traces has router probabilities or weights: those columns stay None.
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.trace.format import MAX_EXPERT_SLOTS, Trace, TraceMeta
from moe_offload.trace.parquet_columns import expert_dtype
from moe_offload.values import integer, memory, number

# zipf_trace samples this many (token, layer, expert) cells per vectorised step: two float64 arrays of this
# size, 64 MB. The chunk depends on L and J only, never on the length, so a seed means one trace.
_ZIPF_CHUNK_CELLS = 1 << 22


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _shape(num_layers, num_experts, tokens, top_k=1, tokens_name: str = "length") -> tuple[int, int, int, int]:
    """The generator's shape, checked before anything is allocated: whole numbers, at most the experts a
    trace may have (MAX_EXPERT_SLOTS), positions that int32 holds, and a trace this machine's memory holds
    (its ids and the validation's int64 copies of them)."""
    num_layers = integer(num_layers, "num_layers", low=1, high=MAX_EXPERT_SLOTS)
    num_experts = integer(num_experts, "num_experts", low=1, high=MAX_EXPERT_SLOTS // num_layers,
                          why=f"at most {MAX_EXPERT_SLOTS:,} experts in all layers")
    tokens = integer(tokens, tokens_name, low=1, high=2**31 - 1, why="positions are 32-bit")
    top_k = integer(top_k, "top_k", low=1)
    memory(tokens * (num_layers * top_k * 9 + 16), f"a trace of {tokens:,} tokens x {num_layers} layers x top-{top_k}")
    return num_layers, num_experts, tokens, top_k


def zipf_probabilities(num_experts: int, a: float, b: float) -> np.ndarray:
    """``p[j-1] = (j + b)^-a / sum_i (i + b)^-a`` for j = 1..J: the popularity law of paper 001, sec. 5.1."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    weights = (ranks + b) ** -float(a)
    return weights / weights.sum()


def zipf_trace(num_layers: int, num_experts: int, top_k: int, length: int, a: float, b: float, seed: int,
               *, shuffle: bool = False) -> Trace:
    """``length`` decode tokens, each selecting ``top_k`` distinct experts per layer, drawn one after the
    other without replacement with Zipf weights ``1 / (j + b)^a`` (expert id ``j - 1`` has popularity
    rank j), as ``rng.choice(replace=False, p=...)`` would: rank r of a token's layer is the r-th draw.

    With ``shuffle=True`` each layer gets its own random permutation of which expert id holds which
    popularity rank (stored in ``meta.extra["popularity_order"]``), so layers differ.
    """
    num_layers, num_experts, length, top_k = _shape(num_layers, num_experts, length, top_k)
    _require(top_k <= num_experts, f"top_k={top_k} exceeds num_experts={num_experts}")
    a = number(a, "Zipf exponent a", low=0)
    b = number(b, "Zipf offset b (j + b > 0 for j = 1)", low=-1, low_open=True)
    seed = integer(seed, "seed", low=0)
    rng = np.random.default_rng(seed)
    probabilities = zipf_probabilities(num_experts, a, b)
    _require(np.count_nonzero(probabilities) >= top_k,
             f"with a={a} the weights of all but {np.count_nonzero(probabilities)} experts underflow to 0, "
             f"fewer than top_k={top_k}")
    # order[l, r] = the expert id of popularity rank r in layer l (the identity unless shuffled).
    order = np.stack([rng.permutation(num_experts) for _ in range(num_layers)]) if shuffle else None

    experts = np.empty((length, num_layers, top_k), dtype=expert_dtype(num_experts))
    chunk_tokens = max(1, _ZIPF_CHUNK_CELLS // (num_layers * num_experts))
    for start in range(0, length, chunk_tokens):
        stop = min(start + chunk_tokens, length)
        ranks = _draw_without_replacement(rng, probabilities, (stop - start) * num_layers, top_k)
        ranks = ranks.reshape(stop - start, num_layers, top_k)
        experts[start:stop] = ranks if order is None else order[np.arange(num_layers)[:, None], ranks]

    params = dict(num_layers=num_layers, num_experts=num_experts, top_k=top_k, length=length, a=float(a),
                  b=float(b), seed=seed, shuffle=shuffle)
    extra = {"generator": "zipf", "params": params,
             "reference": "layered paging (paper 001), section 5.1: p_j ~ 1/(j+b)^a, j = 1..J"}
    if order is not None:
        extra["popularity_order"] = order.tolist()
    meta = TraceMeta(model="synthetic-zipf", num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                     source=_describe("zipf_trace", params), extra=extra)
    return Trace.build(meta, experts)


def cyclic_trace(num_layers: int, cache_size: int, rounds: int) -> Trace:
    """Theorem 3.3 of paper 001: ``n = (k + 1) / L`` experts per layer, round i requests expert ``i mod n``
    of every layer, so the ``k + 1`` pages recur cyclically and LRU (cache of k) misses on every request."""
    cache_size = integer(cache_size, "cache_size", low=1, high=MAX_EXPERT_SLOTS - 1)
    num_layers, _, rounds, _ = _shape(num_layers, 1, rounds, tokens_name="rounds")
    _require((cache_size + 1) % num_layers == 0,
             f"the cyclic sequence of Theorem 3.3 needs num_layers to divide cache_size + 1, but "
             f"{num_layers} does not divide {cache_size + 1}")
    n = (cache_size + 1) // num_layers
    per_round = np.arange(rounds) % n
    experts = np.broadcast_to(per_round[:, None, None], (rounds, num_layers, 1))
    params = dict(num_layers=num_layers, cache_size=cache_size, rounds=rounds)
    meta = TraceMeta(model="synthetic-cyclic", num_layers=num_layers, num_experts=n, top_k=1,
                     source=_describe("cyclic_trace", params),
                     extra={"generator": "cyclic", "params": params,
                            "reference": "layered paging (paper 001), Theorem 3.3"})
    return Trace.build(meta, experts)


def fixed_partition_trace(num_layers: int, num_experts: int, rounds: int, cycling_layer: int = 0) -> Trace:
    """Theorem 3.1 of paper 001: round i requests expert 0 of every layer except ``cycling_layer``, which
    requests expert ``i mod n``. A cache giving that layer fewer than n slots misses every n rounds; one
    that holds the n + L - 1 requested experts never misses after warm-up."""
    num_layers, num_experts, rounds, _ = _shape(num_layers, num_experts, rounds, tokens_name="rounds")
    cycling_layer = integer(cycling_layer, "cycling_layer", low=0, high=num_layers - 1, why="a layer index")
    experts = np.zeros((rounds, num_layers, 1), dtype=np.int64)
    experts[:, cycling_layer, 0] = np.arange(rounds) % num_experts
    params = dict(num_layers=num_layers, num_experts=num_experts, rounds=rounds, cycling_layer=cycling_layer)
    meta = TraceMeta(model="synthetic-fixed-partition", num_layers=num_layers, num_experts=num_experts, top_k=1,
                     source=_describe("fixed_partition_trace", params),
                     extra={"generator": "fixed-partition", "params": params,
                            "reference": "layered paging (paper 001), Theorem 3.1"})
    return Trace.build(meta, experts)


def _draw_without_replacement(rng: np.random.Generator, probabilities: np.ndarray, rows: int,
                              draws: int) -> np.ndarray:
    """[rows, draws] category indices: each row draws ``draws`` distinct categories one at a time, each with
    probability proportional to ``probabilities`` among the categories it has not drawn yet.

    Inverse-CDF sampling on the categories still available. Arrays are laid out [category, row] and the
    running sums are taken one category at a time, because NumPy's reductions along a short last axis
    (argsort, argpartition, cumsum) pay a per-row overhead that made this 3x slower. The draw is the first
    category whose cumulative available mass exceeds ``u * total``; a drawn category adds no mass, so it can
    never be drawn again, whatever the rounding.
    """
    num_categories = probabilities.size
    result = np.empty((rows, draws), dtype=np.int64)
    every_row = np.arange(rows)
    # The first draw sees every category, so its cumulative masses are the same for all rows.
    cumulative = np.cumsum(probabilities)[:, None]
    if draws > 1:
        available_mass = np.repeat(probabilities[:, None], rows, axis=1)
        running_sum = np.empty_like(available_mass)
    for draw in range(draws):
        if draw:
            available_mass[result[:, draw - 1], every_row] = 0.0
            running_sum[0] = available_mass[0]
            for category in range(1, num_categories):
                np.add(running_sum[category - 1], available_mass[category], out=running_sum[category])
            cumulative = running_sum
        total = cumulative[-1]
        # Strictly below the total, so that some category's cumulative mass exceeds it.
        target = np.minimum(rng.random(rows) * total, np.nextafter(total, 0))
        result[:, draw] = np.count_nonzero(cumulative <= target, axis=0)
    return result


def _describe(function: str, params: dict) -> str:
    arguments = ", ".join(f"{name}={value!r}" for name, value in params.items())
    return f"moe_offload.trace.synthetic.{function}({arguments})"
