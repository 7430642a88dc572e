"""/metrics in the Prometheus text format (prometheus-client), read from the engine's own counters.

The expert-cache counters are the engine's RunResult (``engine.stats``: the same record every table and
JSON reads), collected at each scrape, so they can never disagree with ``generate --json``:

    moe_offload_expert_requests_total{tier}     expert accesses the tier served (host: the fast tier's demand loads)
    moe_offload_expert_hits_total{tier}         of those, resident in the tier
    moe_offload_expert_hit_rate{tier}           hits / requests
    moe_offload_on_demand_loads_total           loads a layer waited for
    moe_offload_expert_bypassed_total           misses the fast tier did not admit, computed on the host
    moe_offload_host_compute_seconds_total      seconds the host computed them (placing policies only)
    moe_offload_prefetches_total{outcome}       issued, used, wasted (evicted unused)
    moe_offload_stall_seconds_total             compute waiting for experts
    moe_offload_link_bytes_total{link}          bytes moved per link ("ssd->fast", "ssd->host", "host->fast")
    moe_offload_link_busy_seconds_total{link}   seconds a transfer was on each link

and from the scheduler and the server: ``moe_offload_requests_running``/``_waiting``, the batch size of each
forward pass (``moe_offload_batch_size``), TTFT and TPOT histograms, finished requests by finish reason,
prompt and generated tokens, and:

    moe_offload_queue_seconds                   histogram: from arrival to joining the batch, per choice
    moe_offload_e2e_seconds                     histogram: from the body's arrival to the answer's end, per request
    moe_offload_rejected_requests_total{reason} requests answered with an error before any work (the
                                                error's code: invalid_value, request_too_large, ...)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class EngineCollector:
    """Collects the engine's counters at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        requests = CounterMetricFamily("moe_offload_expert_requests", "expert accesses served by the tier",
                                       labels=["tier"])
        hits = CounterMetricFamily("moe_offload_expert_hits", "expert accesses found resident in the tier",
                                   labels=["tier"])
        rate = GaugeMetricFamily("moe_offload_expert_hit_rate", "hits / requests of the tier", labels=["tier"])
        for tier, asked in (stats.tier_requests or {}).items():
            found = stats.tier_hits[tier]
            requests.add_metric([tier], asked)
            hits.add_metric([tier], found)
            rate.add_metric([tier], found / asked if asked else 0.0)
        yield from (requests, hits, rate)
        yield CounterMetricFamily("moe_offload_on_demand_loads", "expert loads a layer waited for",
                                  value=stats.on_demand_loads)
        if stats.bypassed is not None:  # a placing policy (runtime/placement.py)
            yield CounterMetricFamily("moe_offload_expert_bypassed", "expert misses computed on the host",
                                      value=stats.bypassed)
            yield CounterMetricFamily("moe_offload_host_compute_seconds", "seconds the host computed bypassed experts",
                                      value=stats.host_compute_seconds)
        prefetches = CounterMetricFamily("moe_offload_prefetches", "prefetches into the fast tier",
                                         labels=["outcome"])
        for outcome, value in (("issued", stats.prefetches_issued), ("used", stats.prefetches_used),
                               ("wasted", stats.prefetches_wasted)):
            prefetches.add_metric([outcome], value or 0)
        yield prefetches
        yield CounterMetricFamily("moe_offload_stall_seconds", "seconds the compute waited for experts",
                                  value=stats.stall_seconds)
        yield CounterMetricFamily("moe_offload_policy_decisions", "evictions the cache's policy chose",
                                  value=stats.policy_decisions)
        yield CounterMetricFamily("moe_offload_policy_decision_seconds", "seconds the policy took to choose them",
                                  value=stats.policy_decision_seconds)
        moved = CounterMetricFamily("moe_offload_link_bytes", "bytes moved per link", labels=["link"])
        for link, nbytes in (stats.bytes_per_link or {}).items():
            moved.add_metric([link], nbytes)
        yield moved
        busy = CounterMetricFamily("moe_offload_link_busy_seconds", "seconds a transfer was on the link",
                                   labels=["link"])
        for link, seconds in self.engine.link_busy_seconds().items():
            busy.add_metric([link], seconds)
        yield busy
        running, waiting = self.engine.scheduler.queued
        yield GaugeMetricFamily("moe_offload_requests_running", "requests in the running batch", value=running)
        yield GaugeMetricFamily("moe_offload_requests_waiting", "requests waiting to join the batch", value=waiting)


class ServerMetrics:
    """The server's registry; an observer of the scheduler (``on_pass``, ``on_finish``)."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        r = self.registry
        self.batch_size = Histogram("moe_offload_batch_size", "requests in each forward pass", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.pass_seconds = Histogram("moe_offload_pass_seconds", "seconds of each forward pass",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("moe_offload_ttft_seconds", "time to first token, from arrival",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("moe_offload_tpot_seconds", "mean time per output token after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter("moe_offload_requests", "finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("moe_offload_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("moe_offload_generated_tokens", "tokens generated", registry=r)
        self.queue = Histogram("moe_offload_queue_seconds", "seconds from arrival to joining the batch",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moe_offload_e2e_seconds", "seconds from a request's arrival to its answer's end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("moe_offload_rejected_requests", "requests refused with an error, by its code",
                                ["reason"], registry=r)
        self.passed_tokens = 0   # tokens sampled in forward passes (one per request of each pass)
        self.prompt_tokens_seen = 0

    def throughput_counts(self) -> tuple[int, int]:
        """(prompt tokens of finished requests, tokens sampled) so far: the periodic throughput line."""
        return self.prompt_tokens_seen, self.passed_tokens

    def on_pass(self, batch: int, seconds: float) -> None:
        self.batch_size.observe(batch)
        self.pass_seconds.observe(seconds)
        self.passed_tokens += batch

    def on_finish(self, completion) -> None:
        self.finished.labels(completion.finish_reason).inc()
        self.prompt_tokens_seen += completion.prompt_tokens
        if completion.queue_seconds is not None:
            self.queue.observe(completion.queue_seconds)
        self.prompt_tokens.inc(completion.prompt_tokens)
        self.generated_tokens.inc(len(completion.token_ids))
        if completion.stats.ttft_seconds is not None:
            self.ttft.observe(completion.stats.ttft_seconds)
        if completion.stats.tpot_seconds is not None:
            self.tpot.observe(completion.stats.tpot_seconds)
