"""coact (policies/coact.py): its evictions on a hand-worked sequence, its victim against the formula recomputed
from scratch, its kernel against its Python form on the real traces, its options and decision cost."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from conftest import QWEN_FILES
from moe_offload.errors import ConfigError
from moe_offload.policies import AccessContext, ModelSpec, make_policy
from moe_offload.simulator import kernels
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.importers import import_routes_json, import_topk_jsonl
from policy_driver import drive

TWO_LAYERS = ModelSpec(num_layers=2, num_experts=3, top_k=1)


def test_evictions_by_hand():
    # K = 1, half-life 1 token (each past activation counts half as much per token). Keys: layer 0 = 0, 1, 2;
    # layer 1 = 3, 4, 5. Tokens: 0 routes (0, 3), 1 routes (1, 4), 2 routes (0, 3); a cache of 3.
    requests = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (1, 0)]
    tokens = [0, 0, 1, 1, 2, 2]
    _, evicted = drive("coact", requests, 3, TWO_LAYERS, tokens=tokens, options={"half_life": 1})
    # t=3 (token 1, key 4 misses): F(0) = F(3) = 1/2, F(1) = 1. After token 0 the counts are c(0) = 1,
    # c(0 -> 3) = 1; the layer-0 expert routed so far in token 1 is 1, never counted: P(3) = 0. V(0) = V(3) = 1/2:
    # the tie goes to 0, requested least recently.
    # Q is 0 throughout: the only pair of finished tokens, (0, 1), counts d(0 -> 1) and d(3 -> 4), and token 1
    # routed 1 and 4, never the first of a pair.
    assert evicted[3] == [0]
    # t=4 (token 2, key 0 misses): F(3) = 1/4, F(1) = F(4) = 1/2. Layer 0 has routed 0 in token 2, and
    # c(0 -> 3) / c(0) = 1, so P(3) = 1 and V(3) = 5/4; P(4) = 0. 1 and 4 tie at 1/2: 1 (requested first) goes,
    # where LRU, blind to the co-activation, evicts 3, the expert token 2 needs next.
    assert evicted[4] == [1]
    assert drive("lru", requests, 3, TWO_LAYERS, tokens=tokens)[1][4] == [3]
    assert evicted[5] == []  # 3 is a hit


def test_values_by_hand():
    policy = make_policy("coact", TWO_LAYERS, options={"half_life": 2})
    cache, ctx = ExpertCache(6, policy), AccessContext()
    for clock, (key, token) in enumerate([(0, 0), (3, 0), (0, 1), (4, 1), (0, 3)]):
        ctx.clock, ctx.token = clock, token
        cache.request(key, ctx)
    # F(0) at token 3: activations at 0, 1, 3 -> 2^(-3/2) + 2^(-2/2) + 1; F(3): 2^(-3/2); F(4): 2^(-2/2).
    # Counts after tokens 0 and 1: c(0) = 2, c(0 -> 3) = c(0 -> 4) = 1; token 3 routed 0 at layer 0, so
    # P(3) = P(4) = 1/2. Consecutive tokens (0, 1): d(0) = 1, d(0 -> 0) = 1 at layer 0; d(3) = 1, d(3 -> 4) = 1
    # at layer 1. Token 3 has routed 0: its Q is for the next token, d(0 -> 0) / d(0) = 1. Token 1 routed 4 at
    # layer 1, never the first of a pair: the Q that token 1 gives 3 and 4 is 0.
    assert policy.value(0, 3) == pytest.approx(2 ** -1.5 + 0.5 + 1 + 1)
    assert policy.value(3, 3) == pytest.approx(2 ** -1.5 + 1 / 2)
    assert policy.value(4, 3) == pytest.approx(0.5 + 1 / 2)
    assert policy.value(5, 3) == 0.0  # never routed, never predicted
    ctx.clock, ctx.token = 5, 4
    cache.request(1, ctx)
    # token 4 routes 1 at layer 0. Token 3 gives 0 Q(0) = 1 while 0 is not routed yet: the pairs (0, 1) and
    # (1, 3) make d(0) = 2, d(0 -> 0) = 2; P is 0 at layer 0. Layer 1 routed nothing in token 3: Q(3) =
    # Q(4) = 0, and 1 was never counted by c: P(3) = P(4) = 0.
    assert policy.value(0, 4) == pytest.approx((2 ** -1.5 + 0.5 + 1) * 2 ** -0.5 + 1)
    assert policy.value(3, 4) == pytest.approx(2 ** -2)
    assert policy.value(4, 4) == pytest.approx(2 ** -1.5)
    assert policy.value(1, 4) == 1.0  # d(1) = 0: no Q


def reference_values(history, token, num_experts, top_k, half_life):
    """V of every key at ``token`` recomputed from the whole request history [(token, key), ...]: F summed
    over each key's activations, P from the co-activations counted over the finished tokens, Q from the pairs
    of consecutive finished tokens: for a key not yet routed in ``token``, given the token before; for one
    routed, given this token's experts so far."""
    activations, by_token = {}, {}
    for t, key in history:
        activations.setdefault(key, set()).add(t)
        by_token.setdefault(t, [])
        if key not in by_token[t]:
            by_token[t].append(key)
    routed, pairs = {}, {}
    for t, keys in by_token.items():
        if t == token:
            continue
        for a in keys:
            routed[a] = routed.get(a, 0) + 1
            for b in keys:
                if b // num_experts == a // num_experts + 1:
                    pairs[a, b] = pairs.get((a, b), 0) + 1
    served = sorted(by_token)

    def successions(last):
        """d(a) and d(a, b) over the pairs of consecutive served tokens whose second is ``last`` or before."""
        followed, successors = {}, {}
        for first, second in zip(served, served[1:]):
            if second > last:
                break
            for a in by_token[first]:
                followed[a] = followed.get(a, 0) + 1
                for b in by_token[second]:
                    if b // num_experts == a // num_experts:
                        successors[a, b] = successors.get((a, b), 0) + 1
        return followed, successors

    def q(key, given, counts):
        followed, successors = counts
        return sum(successors.get((a, key), 0) / followed[a] for a in given
                   if a // num_experts == key // num_experts and followed.get(a)) / top_k

    now = by_token.get(token, [])
    before = served[served.index(token) - 1] if served.index(token) > 0 else None
    values = {}
    for key, tokens in activations.items():
        value = sum(2 ** (-(token - t) / half_life) for t in tokens)
        layer = key // num_experts
        if token not in tokens:
            if layer:
                value += sum(pairs.get((a, key), 0) / routed[a] for a in now
                             if a // num_experts == layer - 1 and routed.get(a)) / top_k
            if before is not None:
                value += q(key, by_token[before], successions(before))
        else:
            value += q(key, now, successions(before if before is not None else -1))
        values[key] = value
    return values


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tight", [True, False])
def test_every_victim_has_the_lowest_value_of_the_formula(seed, tight):
    # both ways of lowering the raised entries at a token's start (to s_e, or to the value there) are bounds
    rng = random.Random(seed)
    spec = ModelSpec(num_layers=3, num_experts=4, top_k=2)
    policy = make_policy("coact", spec, options={"half_life": 3})
    policy._tight = tight
    cache, ctx = ExpertCache(7, policy), AccessContext()
    history, clock = [], 0
    for token in range(60):
        routing = [rng.sample(range(4), 2) if rng.random() < 0.5 else [token % 4, (token + 1) % 4] for _ in range(3)]
        for rank in range(2):
            for layer in range(3):
                key = layer * 4 + routing[layer][rank]
                ctx.clock, ctx.token = clock, token
                history.append((token, key))
                before = set(cache.resident)
                cache.request(key, ctx)
                gone = before - set(cache.resident)
                if gone:
                    values = reference_values(history, token, 4, 2, 3)
                    lowest = min(values[k] for k in before)
                    assert values[gone.pop()] == pytest.approx(lowest, rel=1e-9, abs=1e-12), (token, key)
                clock += 1


def test_values_survive_the_change_of_unit():
    # half-life 1 token: the common unit g_n = 2^(n - n_0) passes e^600 after 866 tokens and is rescaled. Expert 0
    # is activated at every third token, expert 1 at every token, for 2000 tokens: F from the formula, plus Q.
    policy = make_policy("coact", ModelSpec(num_layers=1, num_experts=3, top_k=1), options={"half_life": 1})
    cache, ctx = ExpertCache(3, policy), AccessContext()
    for token in range(2000):
        ctx.token = token
        for key in ([0, 1] if token % 3 == 0 else [1]):
            ctx.clock += 1
            cache.request(key, ctx)
    assert policy._base > 0  # rescaled
    ctx.token = 2000
    ctx.clock += 1
    cache.request(2, ctx)
    # Q from token 1999, which routed 1, with the pairs (m, m + 1) of finished tokens: d(1) = 1999 (m + 1 = 1 ..
    # 1999), d(1 -> 0) = 666 (m + 1 a multiple of 3), d(1 -> 1) = 1999; 2, routed in token 2000, has no d.
    assert policy.value(0, 2000) == pytest.approx(sum(2.0 ** -(2000 - n) for n in range(0, 2000, 3)) + 666 / 1999,
                                                  rel=1e-12)
    assert policy.value(1, 2000) == pytest.approx(sum(2.0 ** -(2000 - n) for n in range(2000)) + 1, rel=1e-12)
    assert policy.value(2, 2000) == 1.0


def test_counts_are_halved_before_they_leave_16_bits(monkeypatch):
    # the limit lowered to 4 tokens: expert 0 (layer 0) is routed in every token, with 3 (layer 1) in tokens
    # 0, 2 and 4 and with 5 in tokens 1 and 3. c(0) reaches 4 when token 3 ends and is halved, with c(0 -> 3) = 2
    # and c(0 -> 5) = 2; token 4 is still being served.
    import moe_offload.policies._coact_tokens as tokens

    monkeypatch.setattr(tokens, "COUNT_LIMIT", 4.0)
    policy = make_policy("coact", TWO_LAYERS)
    cache, ctx = ExpertCache(6, policy), AccessContext()
    for token in range(5):
        for key in (0, 3 if token % 2 == 0 else 5):
            ctx.clock, ctx.token = ctx.clock + 1, token
            cache.request(key, ctx)
    assert policy._routed[0] == 2.0 and policy._inverse_routed[0] == 0.5
    assert policy._cooccur[3:, 0].tolist() == [1, 0, 1] and policy._cooccur.dtype == np.uint16  # c(0, b): column 0


def test_counts_stay_exact_at_the_16_bit_limit():
    # expert 0 (layer 0) with 3 (layer 1) in each of 65,538 tokens, the last being served. When token 65,535
    # ends, c(0) = 65,536 is halved with c(0 -> 3) = 65,535 (its pair of that token not counted yet), then the
    # pair is counted: 32,768 each, and token 65,536 makes them 32,769, where 16-bit pairs counted on would
    # have wrapped to 1. d(3) counts pairs of tokens, one fewer: it reaches 65,536 as token 65,536 ends.
    policy = make_policy("coact", TWO_LAYERS)
    cache, ctx = ExpertCache(6, policy), AccessContext()
    for token in range(65_538):
        for key in (0, 3):
            ctx.clock, ctx.token = ctx.clock + 1, token
            cache.request(key, ctx)
    assert policy._routed[0] == 32_769.0 and policy._cooccur[3, 0] == 32_769
    assert policy._followed[3] == 32_768.0 and policy._successor[3, 0] == 32_768  # d(3 -> 3): column 0 of 3's row


def test_pinned_experts_are_never_victims():
    policy = make_policy("coact", TWO_LAYERS)
    cache, ctx = ExpertCache(2, policy), AccessContext()
    for clock, key in enumerate([0, 1]):
        ctx.clock = ctx.token = clock
        cache.request(key, ctx)
    ctx.clock = ctx.token = 2
    ctx.pinned = frozenset({0})  # 0 has the lowest value, but is pinned: 1 goes
    cache.request(2, ctx)
    assert set(cache.resident) == {0, 2}
    ctx.pinned = frozenset({0, 2})
    from moe_offload.policies import NoEvictableExpert
    with pytest.raises(NoEvictableExpert):
        policy.victim(ctx)


def test_options_and_decision_cost():
    with pytest.raises(ConfigError, match="coact.half_life"):
        make_policy("coact", TWO_LAYERS, options={"half_life": 0})
    with pytest.raises(ConfigError, match="half_lives"):
        make_policy("coact", TWO_LAYERS, options={"half_lives": 2})
    spec = ModelSpec(16, 64, 8)
    # every resident re-keyed, then the victim, each value 2K products and additions and 4 more
    assert make_policy("coact", spec).decision_flops(100) == 101 * (4 * 8 + 4)


needs_numba = pytest.mark.skipif(not kernels.numba_available(), reason="Numba is not installed")


def assert_kernel_is_the_policy(data, fractions=(0.125, 0.5)):
    spec = data.spec
    for fraction in fractions:
        size = round(fraction * spec.num_layers * spec.num_experts)
        reference = replay(data, "coact", size, engine="python")
        assert replay(data, "coact", size, engine="compiled").to_dict() == reference.to_dict(), size


@needs_numba
def test_kernel_is_the_policy_on_the_granite_and_gpt_oss_traces(shared_traces):
    assert_kernel_is_the_policy(ReplayInput.of(import_topk_jsonl(
        shared_traces / "gpt-oss-120b" / "chat_149_tokens.jsonl", num_experts=128)))
    granite = import_topk_jsonl(shared_traces / "granite-3.0-1b-a400m" / "sglang_8_requests.jsonl", num_experts=32)
    assert_kernel_is_the_policy(ReplayInput.of(granite.select(slice(0, 80))))


@needs_numba
def test_kernel_is_the_policy_on_a_qwen_request(qwen_folder):
    trace = import_routes_json([qwen_folder / f"{QWEN_FILES[0]}.json"], num_experts=60)
    assert_kernel_is_the_policy(ReplayInput.of(trace), fractions=(0.25,))


@needs_numba
@pytest.mark.parametrize("half_life", [0.05, 1.0])
def test_kernel_is_the_policy_across_changes_of_unit(half_life):
    # 3,000 tokens: at a half-life of 0.05 tokens the unit is rescaled every 44 tokens, at 1 token every 866
    from moe_offload.trace.synthetic import zipf_trace

    data = ReplayInput.of(zipf_trace(3, 6, 2, 3000, a=1.0, b=1.0, seed=4, shuffle=True))
    for size in (4, 9):
        reference = replay(data, "coact", size, engine="python", options={"half_life": half_life})
        assert replay(data, "coact", size, engine="compiled", options={"half_life": half_life}).to_dict() == \
            reference.to_dict(), size


@needs_numba
def test_kernel_is_the_policy_past_the_16_bit_limit():
    # layer 0 routes expert 0 in every one of 66,000 tokens, so its counts are halved after 65,536; layer 1 routes
    # one of its 3 experts at random, and a cache of 2 makes every decision read the counts
    from moe_offload.trace.format import Trace
    from moe_offload.trace.synthetic import zipf_trace

    base = zipf_trace(2, 3, 1, 66_000, a=1.0, b=1.0, seed=5, shuffle=True)
    experts = np.array(base.experts)
    experts[:, 0, 0] = 0
    assert_kernel_is_the_policy(ReplayInput.of(Trace.build(base.meta, experts)), fractions=(1 / 3,))


def test_the_kernel_runs_uncompiled_with_the_same_misses():
    from moe_offload.policies.coact import CoActivation
    from moe_offload.trace.synthetic import zipf_trace

    data = ReplayInput.of(zipf_trace(4, 8, 2, 120, a=1.0, b=1.0, seed=3, shuffle=True))
    policy = CoActivation(data.spec)
    floats, ints = policy.kernel_arguments()
    seq = data.sequence
    for size in (4, 12):
        hits = np.zeros(4 * 8, np.int64)
        CoActivation.replay_kernel(seq.expert_id.astype(np.int64), seq.token.astype(np.int64), size, 4, 8, floats,
                                   ints.copy(), hits)
        assert hits.reshape(4, 8).sum(axis=1).tolist() == replay(data, "coact", size, engine="python").per_layer_hits
    assert math.isclose(floats[0], math.log(2) / 8)


def test_the_timed_simulator_charges_its_decisions():
    from moe_offload.hardware import resolve_profile
    from moe_offload.simulator.timed.decisions import decision_seconds

    spec = ModelSpec(16, 64, 8)
    hardware = resolve_profile("edge-flashmoe")  # no measured time for coact: its FLOPs at the host's rate
    seconds = decision_seconds(hardware, "coact", make_policy("coact", spec), 512)
    assert seconds == pytest.approx(513 * (4 * 8 + 4) / hardware.host.roofline.flops_per_s) and seconds > 0
