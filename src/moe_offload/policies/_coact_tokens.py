"""coact's bookkeeping between tokens (policies/coact.py's module doc): the common unit and the raised heap
entries at a token's start, and the counts learned from a token that has ended. The policy object and its
compiled replay kernel call the same functions."""

from __future__ import annotations

import math

from moe_offload.policies._ranked import heap_push, heap_update

COUNT_LIMIT = 2.0 ** 16  # c(a) or d(a) at which a's counts are halved (halve): the pairs are 16-bit
RESCALE_EXPONENT = 600.0  # ln g at which the common unit moves to the current token (e^709 overflows)
TIGHT_SHARE = 1 / 8  # K / J from which a token's start re-keys its raised entries to their value (coact.py)


def tight_start(num_experts: int, top_k: int) -> bool:
    """Whether a token's start gives the raised entries their value rather than s_e (coact.py's module doc)."""
    return top_k >= TIGHT_SHARE * num_experts


def new_token(order, scores, stamps, position, size, token, scaled, last_request, raised, raised_keys, raised_count,
              base, decay, tight, successor, inverse_followed, before, before_count, num_experts, top_k, exact,
              events):
    """(n_0, g_n, the raised entries left) for the token ``token`` starting now, ``events`` its start's event
    count. When ln g_n passes RESCALE_EXPONENT every s_e is divided by g_n, which then becomes 1, and every
    entry is set to s_e (module doc). Otherwise the raised entries (the first ``raised_count`` of
    ``raised_keys``) become lower bounds again: lowered to s_e, or where ``tight`` to their value at this
    start, s_e + g_n Q (P is 0 until the layer before routes; ``before`` holds the token just ended), which
    stays raised while above s_e."""
    exponent = decay * (token - base)
    if exponent > RESCALE_EXPONENT:
        factor = math.exp(exponent)
        for key in range(scaled.shape[0]):
            scaled[key] = scaled[key] / factor
        base = token
        for i in range(size):  # the first i entries are a heap: the i-th is pushed again, with its key now
            key = order[i]
            heap_push(order, scores, stamps, position, i, key, scaled[key], last_request[key])
        for i in range(raised_count):
            raised[raised_keys[i]] = False
        return base, 1.0, 0
    scale = math.exp(exponent)
    kept = 0
    for i in range(raised_count):
        key = raised_keys[i]
        at = position[key]
        if at >= 0 and scores[at] > scaled[key]:
            if tight:
                layer = key // num_experts
                first = layer * num_experts
                carried = 0.0
                for j in range(before_count[layer]):
                    a = before[layer, j]
                    carried += successor[key, a - first] * inverse_followed[a]
                value = scaled[key] + scale * (carried / top_k)
                if scores[at] >= value:
                    heap_update(order, scores, stamps, position, size, key, value, last_request[key])
                    exact[key] = events + 1
            else:
                heap_update(order, scores, stamps, position, size, key, scaled[key], last_request[key])
        at = position[key]
        if at >= 0 and scores[at] > scaled[key]:
            raised_keys[kept] = key
            kept += 1
        else:
            raised[key] = False
    return base, scale, kept


def learn(cooccur, routed, inverse_routed, successor, followed, inverse_followed, seen, seen_count, before,
          before_count, num_experts):
    """Count the finished token: c(a) for every routed a, c(a, b) for a at layer l and b at layer l + 1, and
    d(a), d(a, b) for a routed at layer l in the token before (``before``) and b at layer l in this one; and
    the inverses of the counts that changed."""
    num_layers = seen_count.shape[0]
    for layer in range(num_layers):
        first = layer * num_experts
        for i in range(seen_count[layer]):
            a = seen[layer, i]
            routed[a] += 1.0
            if routed[a] >= COUNT_LIMIT:
                halve(cooccur, routed, a, first + num_experts if layer + 1 < num_layers else -1, a - first)
            inverse_routed[a] = 1.0 / routed[a]
            if layer + 1 < num_layers:
                for j in range(seen_count[layer + 1]):
                    cooccur[seen[layer + 1, j], a - first] += 1
        for i in range(before_count[layer]):
            a = before[layer, i]
            followed[a] += 1.0
            if followed[a] >= COUNT_LIMIT:
                halve(successor, followed, a, first, a - first)
            inverse_followed[a] = 1.0 / followed[a]
            for j in range(seen_count[layer]):
                successor[seen[layer, j], a - first] += 1


def halve(pairs, totals, a, first_row, column):
    """Halve a's counts, its total and its pairs (column ``column`` of the layer's rows from ``first_row``;
    -1: none). The pairs are 16-bit: a value reads K of them in each of two rows of tables of L J rows, the
    replay's largest cost, and 16-bit rows take half the cache lines of 32-bit ones: coact's kernel on the
    report's 38.4M requests of a 48 x 128 top-8 trace took 9.3 to 10.1 s against 10.9 to 12.0 s for 32-bit
    counts (best of three, the two taken in turns three times, 2-core AMD EPYC). c(a, b) <= c(a) before a token's
    pairs are counted, so halving the total as it reaches COUNT_LIMIT keeps every pair in range: after 65,536
    tokens that routed a, its older tokens count half, as decay would have it."""
    totals[a] = totals[a] // 2.0
    if first_row >= 0:
        for b in range(first_row, first_row + pairs.shape[1]):
            pairs[b, column] = pairs[b, column] // 2
