"""The measures of a learned eviction network on Belady's samples (training/eviction_samples.py), on hand-built
eviction moments whose answers are counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.training.eviction_samples import BeladySamples, agreement, pair_order_accuracy


def moments(distances, moment):
    """Samples with these next-use distances (-1: none in the rows) at these eviction moments."""
    zero = np.zeros(len(distances), dtype=np.int64)
    return BeladySamples(recency=zero, freq=zero, max_freq=zero, distance=np.asarray(distances, dtype=np.int64),
                         remaining=zero, layer=zero, moment=np.asarray(moment, dtype=np.int64), token=zero,
                         clock=zero, chosen=zero.astype(bool), cache_size=zero, source=zero, per_token=zero + 1)


# Moment 0: residents next used in 1 and 5 requests; moment 1: never again, and in 3.
SAMPLES = moments([1, 5, -1, 3], [0, 0, 1, 1])


@pytest.mark.parametrize("scores, pairs, victims", [
    ([0.0, 1.0, 2.0, 1.0], 1.0, 1.0),   # every pair in next-use order: Belady's victims (5, never) top
    ([1.0, 0.0, 0.0, 1.0], 0.0, 0.0),   # every pair reversed
    ([0.0, 0.0, 0.0, 0.0], 0.5, 0.5),   # all tied: half of each pair; the top goes to the first listed (right once)
])
def test_pair_order_accuracy_and_agreement_by_hand(scores, pairs, victims):
    # every drawn pair with different next uses is one of the two pairs (a partner equal to itself is a tie,
    # left out), so the accuracy does not depend on the draw here
    for seed in range(5):
        assert pair_order_accuracy(SAMPLES, np.asarray(scores), seed) == pairs
    assert agreement(SAMPLES, np.asarray(scores)) == victims


def test_agreement_counts_each_moment_once():
    # moment 0's top (5) is Belady's victim, moment 1's (3, beside one never used again) is not
    assert agreement(SAMPLES, np.array([0.0, 1.0, 0.0, 1.0])) == 0.5
