"""Prometheus metrics for ``GET /metrics`` (only with ``--enable-metrics``).

Two sources feed them:

* per request, the TokenizerManager's ``on_request_finished`` callback hands over a
  ``RequestMetrics`` (arrival, first token, per-message token times, finish): token counters and
  the TTFT / inter-token / end-to-end latency histograms (TTFT and inter-token latency are only
  seen for streamed requests, whose tokens arrive step by step);
* per scrape, the scheduler's internal state (``ControlClient.internal_states``, summed over the
  data-parallel replicas): running and queued requests and KV-cache usage, set as gauges just
  before the text is rendered.

Every series exists twice: under our ``radixserve:`` prefix and under SGLang's ``sglang:`` name
(``num_queue_reqs``, ``num_used_tokens``, ``gen_throughput``, ...), so that dashboards built for
SGLang work unchanged.

The registry is private to the server (never prometheus_client's global one), so two servers in
one process, as in tests, do not collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from radixserve.managers.tokenizer.request_state import RequestMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST
_PREFIX = "radixserve:"
_SGLANG = "sglang:"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Inter-token observations per request are capped so that one long request costs O(1) to record.
_MAX_ITL_OBSERVATIONS = 256

# The gauges and counters, by attribute and metric name (the same), with their help text.
_GAUGES = {
    "num_running_reqs": "Requests in the running batch.",
    "num_queued_reqs": "Requests waiting in the scheduler.",
    "num_used_tokens": "KV slots in use (neither free nor evictable).",
    "token_usage": "Fraction of KV slots in use (neither free nor evictable).",
    "gen_throughput": "Generated tokens per second over the scheduler's last log interval.",
    "cache_hit_rate": "Cached prompt tokens / prompt tokens, over all finished requests.",
    "spec_accept_length": (
        "Speculative decoding: tokens gained per request per verify step (1: no draft kept)."
    ),
    "spec_accept_rate": "Speculative decoding: accepted / proposed draft tokens.",
    # hierarchical cache (docs/hierarchical-cache.md): what each tier holds
    "hicache_host_tokens": "KV tokens the host tier of the hierarchical cache holds.",
    "hicache_host_usage": "Fraction of the host tier's KV tokens in use.",
    "hicache_storage_tokens": "KV tokens in the storage tier's block files.",
}
# Where SGLang's name for a gauge differs from ours.
_SGLANG_GAUGE_NAMES = {"num_queued_reqs": "num_queue_reqs"}
_COUNTERS = {
    "prompt_tokens": "Prompt tokens of finished requests.",
    "cached_tokens": "Prompt tokens served from the prefix cache.",
    # hierarchical cache: hits per tier
    "cached_tokens_host": "Prompt tokens loaded back from the host tier of the cache.",
    "cached_tokens_storage": "Prompt tokens loaded back from the storage tier.",
    "generation_tokens": "Generated tokens.",
    "num_requests": "Finished requests.",
}

class _Both:
    """One series under both prefixes: every update goes to each."""

    def __init__(self, *children: Any) -> None:
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class ServerMetrics:
    """The server's Prometheus collectors, labelled with the served model name."""

    # set from _GAUGES and _COUNTERS in __init__
    num_running_reqs: _Both
    num_queued_reqs: _Both
    num_used_tokens: _Both
    token_usage: _Both
    gen_throughput: _Both
    cache_hit_rate: _Both
    spec_accept_length: _Both
    spec_accept_rate: _Both
    prompt_tokens: _Both
    cached_tokens: _Both
    cached_tokens_host: _Both
    cached_tokens_storage: _Both
    hicache_host_tokens: _Both
    hicache_host_usage: _Both
    hicache_storage_tokens: _Both
    generation_tokens: _Both
    num_requests: _Both

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]

        def gauge(name: str, doc: str, sglang_name: str | None = None) -> _Both:
            return _Both(*(
                Gauge(full, doc, label, registry=self.registry).labels(model_name)
                for full in (_PREFIX + name, _SGLANG + (sglang_name or name))
            ))

        def counter(name: str, doc: str) -> _Both:
            return _Both(*(
                Counter(prefix + name, doc, label, registry=self.registry).labels(model_name)
                for prefix in (_PREFIX, _SGLANG)
            ))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> _Both:
            return _Both(*(
                Histogram(
                    prefix + name, doc, label, buckets=buckets, registry=self.registry
                ).labels(model_name)
                for prefix in (_PREFIX, _SGLANG)
            ))

        for name, doc in _GAUGES.items():
            setattr(self, name, gauge(name, doc, _SGLANG_GAUGE_NAMES.get(name)))
        for name, doc in _COUNTERS.items():
            setattr(self, name, counter(name, doc))
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self._prompt_total = 0
        self._cached_total = 0

    def on_request_finished(self, m: RequestMetrics) -> None:
        """Record one finished request (the TokenizerManager's callback; runs on the loop)."""
        self.num_requests.inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_tokens.inc(m.cached_tokens)
        if m.cached_tokens_details is not None:
            self.cached_tokens_host.inc(m.cached_tokens_details.get("host", 0))
            self.cached_tokens_storage.inc(m.cached_tokens_details.get("storage", 0))
        self.generation_tokens.inc(m.completion_tokens)
        self._prompt_total += m.prompt_tokens
        self._cached_total += m.cached_tokens
        # A non-stream request gets all its tokens in one message at the end, so its first
        # message time is only a first-token time when that message carried a single token.
        if m.first_token_time is not None and m.token_times and m.token_times[0][1] == 1:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        observed = 0
        for (prev_t, _), (t, n) in zip(m.token_times, m.token_times[1:], strict=False):
            # A message with n tokens arrived t - prev_t after the previous one: n gaps.
            per_token = (t - prev_t) / max(n, 1)
            for _ in range(min(n, _MAX_ITL_OBSERVATIONS - observed)):
                self.itl.observe(per_token)
            observed += n
            if observed >= _MAX_ITL_OBSERVATIONS:
                break
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)

    def update_scheduler_state(self, states: list[dict[str, Any]]) -> None:
        """Set the gauges from the replicas' ``GetInternalStateReqOutput.state`` (one per
        data-parallel replica: the server's totals)."""
        self.num_running_reqs.set(sum(s.get("num_running_reqs", 0) for s in states))
        self.num_queued_reqs.set(sum(s.get("num_waiting_reqs", 0) for s in states))
        self.gen_throughput.set(sum(s.get("gen_throughput", 0.0) for s in states))
        memories = [s.get("memory", {}) for s in states]
        total = sum(m.get("total_kv_tokens", 0) for m in memories)
        if total:
            free = sum(
                m.get("available_kv_tokens", 0) + m.get("evictable_kv_tokens", 0)
                for m in memories
            )
            self.num_used_tokens.set(total - free)
            self.token_usage.set((total - free) / total)
        if any("host_total_kv_tokens" in m for m in memories):
            host = sum(m.get("host_kv_tokens", 0) for m in memories)
            host_total = sum(m.get("host_total_kv_tokens", 0) for m in memories)
            self.hicache_host_tokens.set(host)
            self.hicache_host_usage.set(host / host_total if host_total else 0.0)
            self.hicache_storage_tokens.set(sum(m.get("storage_kv_tokens", 0) for m in memories))
        speculative = [s for s in states if "avg_spec_accept_length" in s]
        if speculative:
            n = len(speculative)
            self.spec_accept_length.set(sum(s["avg_spec_accept_length"] for s in speculative) / n)
            self.spec_accept_rate.set(sum(s["spec_accept_rate"] for s in speculative) / n)
        if self._prompt_total:
            self.cache_hit_rate.set(self._cached_total / self._prompt_total)

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)
