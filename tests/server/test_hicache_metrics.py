"""The hierarchical cache's Prometheus series: hits per tier from finished requests, and what
each tier holds from the scheduler's memory figures (docs/hierarchical-cache.md)."""

from __future__ import annotations

from radixserve.managers.tokenizer.request_state import RequestMetrics
from radixserve.server.metrics import ServerMetrics


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_tier_hits_and_sizes_are_exported_under_both_prefixes():
    metrics = ServerMetrics("m")
    for host, storage in ((64, 0), (0, 128)):
        metrics.on_request_finished(RequestMetrics(
            rid="r", arrival_time=0.0, prompt_tokens=300, cached_tokens=host + storage + 8,
            cached_tokens_details={"device": 8, "host": host, "storage": storage},
        ))
    metrics.update_scheduler_state([{"memory": {
        "total_kv_tokens": 512, "available_kv_tokens": 512, "evictable_kv_tokens": 0,
        "host_kv_tokens": 256, "host_total_kv_tokens": 1024, "storage_kv_tokens": 640,
    }}])
    text = metrics.render().decode()
    for prefix in ("radixserve:", "sglang:"):
        assert _value(text, prefix + "cached_tokens_host_total") == 64
        assert _value(text, prefix + "cached_tokens_storage_total") == 128
        assert _value(text, prefix + "hicache_host_tokens") == 256
        assert _value(text, prefix + "hicache_host_usage") == 0.25
        assert _value(text, prefix + "hicache_storage_tokens") == 640
