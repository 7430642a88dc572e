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
from moe_offload.trace.format import Trace, TraceMeta

# Tokens sampled per vectorised step of zipf_trace. A constant (not derived from the arguments) so that a
# seed gives the same trace whatever the length; 2**15 tokens of 32 layers x 8 experts is 8M keys (32 MB).
_ZIPF_CHUNK_TOKENS = 1 << 15


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive_int(name: str, value) -> None:
    _require(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1,
             f"{name} must be a positive integer, not {value!r}")


def zipf_probabilities(num_experts: int, a: float, b: float) -> np.ndarray:
    """``p[j-1] = (j + b)^-a / sum_i (i + b)^-a`` for j = 1..J: the popularity law of paper 001, sec. 5.1."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    weights = (ranks + b) ** -float(a)
    return weights / weights.sum()


def zipf_trace(num_layers: int, num_experts: int, top_k: int, length: int, a: float, b: float, seed: int,
               *, shuffle: bool = False) -> Trace:
    """``length`` decode tokens, each selecting ``top_k`` distinct experts per layer, drawn without
    replacement with Zipf weights ``1 / (j + b)^a`` (expert id ``j - 1`` has weight rank j).

    Sampling without replacement uses exponential keys (Efraimidis-Spirakis): expert j gets key
    ``E_j / w_j`` with ``E_j ~ Exp(1)``, and the ``top_k`` smallest keys, in increasing order, have the
    distribution of drawing one expert at a time with probabilities proportional to the weights of those
    not yet drawn (what ``rng.choice(replace=False)`` does). Ranks are therefore meaningful: rank 0 is the
    first draw. With ``shuffle=True`` each layer gets its own random permutation of which expert id holds
    which popularity rank (stored in ``meta.extra["popularity_order"]``), so layers differ.
    """
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k),
                        ("length", length)):
        _positive_int(name, value)
    _require(top_k <= num_experts, f"top_k={top_k} exceeds num_experts={num_experts}")
    _require(np.isfinite(a) and a >= 0, f"Zipf exponent a must be a finite number >= 0, not {a!r}")
    _require(np.isfinite(b) and b > -1, f"Zipf offset b must be a finite number > -1 (so that j + b > 0 "
                                        f"for j = 1), not {b!r}")
    rng = np.random.default_rng(seed)
    weights = zipf_probabilities(num_experts, a, b).astype(np.float32)
    # order[l, r] = the expert id of popularity rank r in layer l.
    if shuffle:
        order = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])
    else:
        order = np.broadcast_to(np.arange(num_experts), (num_layers, num_experts))

    ranks = np.empty((length, num_layers, top_k), dtype=np.int64)
    for start in range(0, length, _ZIPF_CHUNK_TOKENS):
        stop = min(start + _ZIPF_CHUNK_TOKENS, length)
        keys = rng.standard_exponential((stop - start, num_layers, num_experts), dtype=np.float32)
        keys /= weights
        if top_k == num_experts:
            smallest = np.argsort(keys, axis=-1)
        else:
            candidates = np.argpartition(keys, top_k - 1, axis=-1)[..., :top_k]
            within = np.argsort(np.take_along_axis(keys, candidates, axis=-1), axis=-1)
            smallest = np.take_along_axis(candidates, within, axis=-1)
        ranks[start:stop] = smallest
    experts = np.take_along_axis(np.broadcast_to(order, (length, num_layers, num_experts)), ranks, axis=-1)

    params = dict(num_layers=num_layers, num_experts=num_experts, top_k=top_k, length=length, a=float(a),
                  b=float(b), seed=seed, shuffle=shuffle)
    extra = {"generator": "zipf", "params": params,
             "reference": "layered paging (paper 001), section 5.1: p_j ~ 1/(j+b)^a, j = 1..J"}
    if shuffle:
        extra["popularity_order"] = order.tolist()
    meta = TraceMeta(model="synthetic-zipf", num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                     source=_describe("zipf_trace", params), extra=extra)
    return Trace.build(meta, experts)


def cyclic_trace(num_layers: int, cache_size: int, rounds: int) -> Trace:
    """Theorem 3.3 of paper 001: ``n = (k + 1) / L`` experts per layer, round i requests expert ``i mod n``
    of every layer, so the ``k + 1`` pages recur cyclically and LRU (cache of k) misses on every request."""
    for name, value in (("num_layers", num_layers), ("cache_size", cache_size), ("rounds", rounds)):
        _positive_int(name, value)
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
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("rounds", rounds)):
        _positive_int(name, value)
    _require(isinstance(cycling_layer, (int, np.integer)) and 0 <= cycling_layer < num_layers,
             f"cycling_layer must be a layer index in 0..{num_layers - 1}, not {cycling_layer!r}")
    experts = np.zeros((rounds, num_layers, 1), dtype=np.int64)
    experts[:, cycling_layer, 0] = np.arange(rounds) % num_experts
    params = dict(num_layers=num_layers, num_experts=num_experts, rounds=rounds, cycling_layer=cycling_layer)
    meta = TraceMeta(model="synthetic-fixed-partition", num_layers=num_layers, num_experts=num_experts, top_k=1,
                     source=_describe("fixed_partition_trace", params),
                     extra={"generator": "fixed-partition", "params": params,
                            "reference": "layered paging (paper 001), Theorem 3.1"})
    return Trace.build(meta, experts)


def _describe(function: str, params: dict) -> str:
    arguments = ", ".join(f"{name}={value!r}" for name, value in params.items())
    return f"moe_offload.trace.synthetic.{function}({arguments})"
