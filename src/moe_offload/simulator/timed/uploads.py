"""Uploads between passes: the admission of llama.cpp PR #27861's GPU cache of host-resident experts
(ggml-org/llama.cpp pull request 27861, "llama: GPU-resident LRU cache for host-offloaded MoE expert
weights", ``--moe-expert-cache N``, ``--moe-expert-cache-inserts M``; its src/llama-moecache.cpp:
``moe_obs_cb``, the upload worker and ``llama_moe_cache_step``).

What the PR does, and how the timed run follows it:

* The cache. Every host-resident expert layer gets N slots in VRAM (companion tensors of N + 1 experts: slot
  N is permanently zero, so a layer costs N + 1 experts of VRAM) and an expert id -> slot table. The run's
  GPU cache is ``lru-dist`` on N slots per layer (PartitionedCache, one LRU per layer): the PR keeps a
  Lamport clock per slot, set by every hit and by every publication, and evicts the slot of least clock.
* A pass of one token (``n_tokens == 1``: decoding one sequence) reads the table: a routed expert that is in
  its layer's cache is a hit, computed on the GPU (``touch``: the LRU hears it); any other is computed on
  the host from host memory (a refused admission: simulator/cache.py, Admission) and remembered, each once,
  in the order it was routed (``pending``). A pass of more tokens (a prefill, a batch of sequences) does not
  build the cache's graph: every expert of its host layers runs on the host, hits included, and the cache
  hears nothing of it (``serves``).
* After each pass (``llama_moe_cache_step``): first the uploads that have landed since the last step are
  published (``complete``: resident from the next pass, in the order they landed); then, per layer, the
  remembered misses are walked from the most recent back, at most M of them (M = ``inserts``, default 2; a
  missed expert that is resident by now, published this step, still counts against M): each gets the
  layer's empty slot, else its least recently used one not awaiting an upload, whose expert leaves at once
  (``reserve``); when every slot awaits an upload the walk stops. The worker thread copies the experts to
  the GPU one after another over the host link, off the compute stream; an upload is published at the first
  step after it has landed (at the earliest: after the next pass).

The upload copies are the only transfers of such a run: no miss is fetched on demand and no prefetcher may
run, so they have the host link to themselves and are timed here, one after another from when each is
scheduled. Where the model departs from the PR: an expert routed again while its upload is on the wire is
not uploaded a second time (the PR, which marks an expert cached only once published, would copy it into a
second slot; this needs an upload slower than a whole pass).
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.values import integer

PR = "llama.cpp PR #27861"


class UploadsBetweenPasses:
    """The admission rule ``(key, ctx) -> bool`` of the GPU cache (simulator/cache.py: it refuses every miss,
    remembering it) and the step between passes (module doc). ``inserts``: uploads per layer per step;
    ``max_pass_tokens``: the largest pass the cache serves (1 in the PR)."""

    name = "uploads-between-passes"

    def __init__(self, inserts: int = 2, max_pass_tokens: int = 1):
        self.inserts = integer(inserts, f"{PR} inserts", low=1)
        self.max_pass_tokens = integer(max_pass_tokens, f"{PR} max_pass_tokens", low=1)
        self.missed: dict[int, None] = {}  # this pass's misses, in the order they were routed
        self.on_wire: list[tuple[float, int]] = []  # (lands at, key), in the order they were scheduled
        self.worker_free = 0.0  # when the upload worker has copied what it was given
        self.uploads = 0
        self.published = 0

    def serves(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens reads the cache (module doc)."""
        return tokens <= self.max_pass_tokens

    def __call__(self, key, ctx) -> bool:
        self.missed[key] = None
        return False

    def between_passes(self, cache, ctx, now: float, upload_seconds: float, num_experts: int,
                       expert_bytes: int) -> list:
        """The step after a pass ending at ``now``: publish what has landed, then schedule this pass's uploads
        into ``cache`` (module doc), experts of ``expert_bytes``. Returns the scheduled (key, start, end) for the
        timeline; each upload takes ``upload_seconds``."""
        landed = [key for end, key in self.on_wire if end <= now]
        self.on_wire = [(end, key) for end, key in self.on_wire if end > now]
        for key in landed:
            cache.complete(key, ctx)
        self.published += len(landed)
        by_layer: dict[int, list[int]] = {}
        for key in self.missed:
            by_layer.setdefault(key // num_experts, []).append(key)
        self.missed = {}
        scheduled = []
        for layer in sorted(by_layer):
            for key in list(reversed(by_layer[layer]))[:self.inserts]:
                if key in cache or key in cache.reserved:  # resident, or already on the wire (module doc)
                    continue
                if not cache.reserve(key, ctx, expert_bytes):
                    break  # every slot of the layer awaits an upload
                start = max(now, self.worker_free)
                self.worker_free = end = start + upload_seconds
                self.on_wire.append((end, key))
                scheduled.append((key, start, end))
        self.uploads += len(scheduled)
        return scheduled


def check_uploads(policy_static: bool, partitioned: bool, prefetcher, home: int | None, hardware_name: str) -> None:
    """ConfigError unless the run can follow the PR: a per-layer dynamic cache (``-dist``), no prefetcher, and
    the experts' home in host memory (the tier after the GPU), which the PR uploads from."""
    if policy_static or not partitioned:
        raise ConfigError(f"{PR}'s uploads fill a cache of N slots per layer: give a -dist policy (lru-dist)")
    if prefetcher is not None:
        raise ConfigError(f"{PR}'s cache loads only between passes: no prefetcher runs with it")
    if home != 1:
        raise ConfigError(f"hardware {hardware_name}: {PR} uploads experts from host memory, but the experts do not "
                          "fit in the tier after the GPU")
