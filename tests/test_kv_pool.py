"""The batching scheduler's KV pool (runtime/kv_pool.py) and the packed pass's attention over it
(runtime/packed.py ``segmented_attention``), against transformers' sdpa attention over each request's keys and
values alone, as contiguous tensors (what a request's own pass attends over): exact batch math bit for bit,
fast batch math (the decoding requests in one masked call) to rounding, also where a slot still holds a
longer, finished request's keys beyond its own length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from moe_offload.runtime.kv_pool import KVPool  # noqa: E402
from moe_offload.runtime.packed import PackedPass, Segment, segmented_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 6, 2, 32
MODULE = SimpleNamespace(layer_idx=3, num_key_value_groups=HEADS // KV_HEADS, is_causal=True)


def test_slots_are_handed_out_lowest_first_and_the_tensors_grow_keeping_what_is_held():
    pool = KVPool(6)
    first, second = pool.acquire(), pool.acquire()
    assert (first, second) == (0, 1)
    pool.reserve(2, 10)
    assert (pool.rows, pool.capacity) == (4, 64)
    keys, values = pool.layer(0, torch.zeros(1, KV_HEADS, 1, DIM))
    assert keys.shape == (4, KV_HEADS, 64, DIM) and not keys.any()  # zeros, never uninitialised memory
    keys[1, :, :5] = 7.0
    pool.commit(1, 5)
    pool.release(0)
    assert pool.acquire() == 0 and [pool.acquire() for _ in range(4)] == [2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="max_batch"):
        pool.acquire()
    pool.reserve(6, 130)
    assert (pool.rows, pool.capacity) == (6, 256)  # doubled, at most the pool's slots
    keys, _ = pool.layer(0, None)
    assert keys.shape == (6, KV_HEADS, 256, DIM)
    assert bool((keys[1, :, :5] == 7).all()) and int((keys != 0).sum()) == KV_HEADS * 5 * DIM
    pool.release(1)
    assert pool.lengths[1] == 0 and pool.acquire() == 1
    pool.reserve(3, 100)  # fits already: nothing changes
    assert (pool.rows, pool.capacity) == (6, 256) and pool.layer(0, None)[0] is keys


def test_a_pool_that_cannot_grow_stays_as_it_was():
    class OutOfMemory:  # a layer's tensor whose larger copy cannot be made
        shape = (4, KV_HEADS, 64, DIM)

        def new_zeros(self, *shape):
            raise MemoryError("out of memory")

    pool = KVPool(8)
    pool.reserve(2, 10)
    keys, values = pool.layer(0, torch.zeros(1, KV_HEADS, 1, DIM))
    pool.keys[1], pool.values[1] = OutOfMemory(), OutOfMemory()
    with pytest.raises(MemoryError):
        pool.reserve(8, 500)
    assert (pool.rows, pool.capacity) == (4, 64) and pool.keys[0] is keys and pool.values[0] is values


def run_pass(pool, requests, exact, generator):
    """One packed pass over ``requests`` [(slot, new tokens)]: random queries, keys and values; returns the
    pass's output and its inputs, and commits the new tokens."""
    segments, start = [], 0
    for request, (slot, new) in enumerate(requests):
        segments.append(Segment(request, start, start + new, pool.lengths[slot] == 0 and new > 1, slot,
                                pool.lengths[slot]))
        start += new
    packed = PackedPass(segments, pool, exact)
    pool.reserve(max(s.slot for s in segments) + 1, max(s.past + s.end - s.start for s in segments))
    query = torch.randn(1, HEADS, start, DIM, generator=generator)
    key = torch.randn(1, KV_HEADS, start, DIM, generator=generator)
    value = torch.randn(1, KV_HEADS, start, DIM, generator=generator)
    output, _ = segmented_attention(MODULE, query, key, value, None, packed=packed, scaling=DIM ** -0.5)
    for s in segments:
        pool.commit(s.slot, s.end - s.start)
    return output, segments, query, key, value


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("layout", [(0, 1, 2), (0, 2, 3), (0, 5, 7)])  # packed; a hole; scattered (a copy)
def test_each_segment_attends_over_its_own_keys_as_if_alone(exact, layout):
    generator = torch.Generator().manual_seed(5)
    pool = KVPool(8)
    history = {}  # slot -> (keys, values) [1, kv_heads, n, dim] as its own pass would hold them
    taken = [pool.acquire() for _ in range(8)]
    run_pass(pool, [(slot, 40) for slot in taken], exact, generator)  # long requests that leave: their keys stay
    for slot in layout:  # new requests in the slots of some that left (the lowest free slot first)
        pool.release(slot)
        assert pool.acquire() == slot
    for slot in taken:
        if slot not in layout:
            pool.release(slot)
    slots = list(layout)
    for step, requests in enumerate([[(slots[0], 9), (slots[1], 3)],                  # two prompts
                                     [(slots[0], 1), (slots[1], 1), (slots[2], 5)],  # two decode, a prompt
                                     [(slots[0], 1), (slots[1], 1), (slots[2], 1)],  # all decode
                                     [(slots[0], 1), (slots[1], 1), (slots[2], 1)]]):
        output, segments, query, key, value = run_pass(pool, requests, exact, generator)
        for s in segments:
            new_keys, new_values = key[:, :, s.start:s.end], value[:, :, s.start:s.end]
            held_keys, held_values = history.get(s.slot, (new_keys[:, :, :0], new_values[:, :, :0]))
            history[s.slot] = (torch.cat([held_keys, new_keys], 2), torch.cat([held_values, new_values], 2))
            alone, _ = sdpa_attention_forward(MODULE, query[:, :, s.start:s.end], *history[s.slot], None,
                                              scaling=DIM ** -0.5)
            got = output[:, s.start:s.end]
            if exact or s.end - s.start > 1 or len([t for t in segments if t.end - t.start == 1]) < 2:
                assert torch.equal(got, alone), (step, s)
            else:
                torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)
    assert pool.lengths[slots[0]] == 12 and pool.lengths[slots[2]] == 7


def test_fast_attention_runs_in_place_over_packed_slots_and_on_a_copy_of_scattered_ones():
    pool = KVPool(8)
    for slots, span in [((0, 1, 2), 3), ((0, 2, 3), 4), ((0, 5, 7), None)]:
        segments = [Segment(i, i, i + 1, False, slot, 4 + i) for i, slot in enumerate(slots)]
        got, mask = PackedPass(segments, pool, exact=False).decoding_mask
        assert got == span
        rows = [[int(i) for i in row[0, 0].nonzero()] for row in mask]
        if span is None:
            assert rows == [list(range(5 + i)) for i in range(3)]
        else:
            expected = [[0]] * span
            for i, slot in enumerate(slots):
                expected[slot] = list(range(5 + i))
            assert rows == expected


def test_a_pass_that_is_not_committed_leaves_the_requests_as_they_were():
    """A failed pass rolls back by not committing: the next pass overwrites what it wrote."""
    generator = torch.Generator().manual_seed(9)
    pool = KVPool(1)
    slot = pool.acquire()
    run_pass(pool, [(slot, 4)], True, generator)
    keys_before = pool.layer(MODULE.layer_idx, None)[0][slot, :, :4].clone()
    segments = [Segment(0, 0, 1, False, slot, 4)]
    key = torch.randn(1, KV_HEADS, 1, DIM, generator=generator)
    segmented_attention(MODULE, torch.randn(1, HEADS, 1, DIM, generator=generator), key, key, None,
                        packed=PackedPass(segments, pool), scaling=DIM ** -0.5)  # written, never committed
    assert pool.lengths[slot] == 4
    assert torch.equal(pool.layer(MODULE.layer_idx, None)[0][slot, :, :4], keys_before)
