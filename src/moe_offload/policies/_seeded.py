"""The seeded draws of the randomized policies (Random, Marking, LeCaR), in Python and in the compiled kernels.

``draw_below(rng, n)`` is a uniform integer in [0, n) from a ``random.Random``: rejection sampling on
``rng.getrandbits(k)`` with k = n.bit_length(), which is what CPython's ``randrange(n)`` does. It is written
out rather than called as ``randrange`` so that the compiled replay kernels (simulator/kernels.py) can draw
exactly the same numbers whatever the Python version: ``rng_state(rng)`` copies the generator's Mersenne
Twister state into an array, and ``mt_draw_below(state, n)`` continues it with MT19937 (Matsumoto and
Nishimura 1998, the generator of CPython's ``random``) in the subset of Python that Numba compiles. With the
same seed the Python policy and its kernel therefore evict the same experts, which the tests check.
``mt_random(state)`` continues it as ``rng.random()`` does: a float in [0, 1) from 53 bits of two outputs.
"""

from __future__ import annotations

import random

import numpy as np

_N, _M = 624, 397  # MT19937's state size and shift


def draw_below(rng: random.Random, n: int) -> int:
    k = n.bit_length()
    r = rng.getrandbits(k)
    while r >= n:
        r = rng.getrandbits(k)
    return r


def rng_state(rng: random.Random) -> np.ndarray:
    """The generator's 624 state words and its position, as int64 (what ``mt_draw_below`` continues)."""
    return np.array(rng.getstate()[1], dtype=np.int64)


def _mt_next(state):
    """The next 32-bit output of the Mersenne Twister whose words and position are ``state``."""
    index = state[_N]
    if index >= _N:
        for i in range(_N):
            y = (state[i] & 0x80000000) | (state[(i + 1) % _N] & 0x7FFFFFFF)
            value = state[(i + _M) % _N] ^ (y >> 1)
            if y & 1:
                value ^= 0x9908B0DF
            state[i] = value
        index = 0
    y = state[index]
    state[_N] = index + 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    y ^= y >> 18
    return y


def mt_draw_below(state, n):
    """``draw_below`` on the generator whose state is ``state`` (updated in place); n < 2**32."""
    k = 0
    while (n >> k) > 0:
        k += 1
    r = _mt_next(state) >> (32 - k)
    while r >= n:
        r = _mt_next(state) >> (32 - k)
    return r


def mt_random(state):
    """``random.Random.random()`` on the generator whose state is ``state`` (updated in place): CPython's
    ``random_random``, (a * 2**26 + b) / 2**53 with a and b the top 27 and 26 bits of two outputs."""
    a = _mt_next(state) >> 5
    b = _mt_next(state) >> 6
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)
