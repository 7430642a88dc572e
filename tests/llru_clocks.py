"""LLRU's clock as each driver gives it, for the tests that check the timed simulator and the runtime (whole
experts and split) against the replay: a spy of LLRU that records every access's clock, and the replay's
clock (trace/flatten.py) of each expert's first request in a forward pass, which is the clock LLRU must see
(round * L + layer, K rounds per layer per token, batching included)."""

from __future__ import annotations


def spy_on_llru(monkeypatch, victims: list | None = None) -> list:
    """Register policy "test-llru": LLRU that appends (ctx.iteration, key, clock) for each access to the list
    returned, and (ctx.iteration, victim) for each eviction to ``victims`` when given."""
    from moe_offload.policies import POLICIES, PolicyInfo
    from moe_offload.policies.llru import LLRU

    seen = []

    class Spy(LLRU):
        name = "test-llru"

        def on_access(self, key, ctx):
            seen.append((ctx.iteration, key, self._clock(ctx)))
            super().on_access(key, ctx)

        def victim(self, ctx):
            key = super().victim(ctx)
            if victims is not None:
                victims.append((ctx.iteration, key))
            return key

    monkeypatch.setitem(POLICIES, "test-llru", PolicyInfo("test-llru", Spy))
    return seen


def first_request_clocks(trace, passes) -> list[tuple[int, int, int]]:
    """(pass, key, clock) for each expert each layer of each pass requests, in pass, layer and key order: the
    replay's clock of the key's first request among the pass's trace rows. ``passes``: (pass, rows) pairs."""
    import numpy as np

    from moe_offload.trace.flatten import flatten

    flat = flatten(trace)
    expected = []
    for iteration, rows in passes:
        for layer in range(trace.meta.num_layers):
            in_pass = np.isin(flat.token, rows) & (flat.layer == layer)
            keys, clocks = flat.expert_id[in_pass].tolist(), np.flatnonzero(in_pass).tolist()
            expected += [(int(iteration), key, clocks[keys.index(key)]) for key in sorted(set(keys))]
    return expected
