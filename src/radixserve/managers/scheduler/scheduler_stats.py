"""What the scheduler reports about its steps: SGLang's periodic log lines, the generation
throughput ``/metrics`` exports as ``sglang:gen_throughput``, and a short history of steps for the
inspector page.

    Prefill batch. #new-seq: 2, #new-token: 37, #cached-token: 12, token usage: 0.03,
        #running-req: 1, #queue-req: 0                        (every prefill batch)
    Decode batch. #running-req: 3, #token: 180, token usage: 0.04, gen throughput (token/s):
        41.27, #queue-req: 0                                  (every DECODE_LOG_INTERVAL steps)
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from radixserve.managers.io_struct import LoadReport
from radixserve.managers.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger("radixserve.managers.scheduler.scheduler")

DECODE_LOG_INTERVAL = 40
HISTORY_STEPS = 240


def token_usage(memory: dict[str, int]) -> tuple[int, float]:
    """``(used, fraction)`` of KV slots neither free nor evictable (sessions' slots count)."""
    total = memory["total_kv_tokens"]
    used = total - memory["available_kv_tokens"] - memory["evictable_kv_tokens"]
    return used, used / total if total else 0.0


class SchedulerStats:
    def __init__(self) -> None:
        self.num_steps = 0
        self.num_prefill_steps = 0
        self.num_prefill_tokens = 0  # tokens prefill steps computed (cached prefixes excluded)
        self.num_generated_tokens = 0  # over the server's life
        self.gen_throughput = 0.0  # tokens/s over the last decode log interval
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_STEPS)
        self._decode_steps = 0
        self._interval_tokens = 0
        self._interval_start = time.perf_counter()

    def record(
        self,
        batch: ScheduleBatch,
        step_seconds: float,
        memory: dict[str, int],
        num_running: int,
        num_waiting: int,
    ) -> None:
        """One model step ran ``batch``; ``num_running`` counts the running batch before a
        prefill joined it (as SGLang logs it)."""
        self.num_steps += 1
        used, usage = token_usage(memory)
        prefill = batch.forward_mode.is_extend
        new_tokens = sum(batch.extend_lens_cpu) if prefill else len(batch)
        self.history.append({
            "time": time.time(),
            "kind": "prefill" if prefill else "decode",
            "batch_size": len(batch),
            "new_tokens": new_tokens,
            "step_ms": step_seconds * 1000.0,
            "kv_used": used,
            "kv_evictable": memory["evictable_kv_tokens"],
            "kv_session": memory["session_held_kv_tokens"],
            "kv_total": memory["total_kv_tokens"],
            "running": num_running,
            "waiting": num_waiting,
        })
        if prefill:
            self.num_prefill_steps += 1
            self.num_prefill_tokens += new_tokens
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d",
                len(batch), new_tokens, sum(batch.prefix_lens_cpu), usage, num_running,
                num_waiting,
            )
            return
        self.num_generated_tokens += new_tokens
        self._interval_tokens += new_tokens
        self._decode_steps += 1
        if self._decode_steps % DECODE_LOG_INTERVAL == 0:
            now = time.perf_counter()
            self.gen_throughput = self._interval_tokens / max(now - self._interval_start, 1e-9)
            self._interval_tokens, self._interval_start = 0, now
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d",
                len(batch), used, usage, self.gen_throughput, num_waiting,
            )

    def summary(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "num_prefill_steps": self.num_prefill_steps,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "gen_throughput": self.gen_throughput,
        }


class LoadReporter:
    """Sends a replica's load to the data-parallel controller when it changed (its
    ``LoadReport``s choose the replica of the next request)."""

    def __init__(self, dp_rank: int, send_load: Callable[[LoadReport], None]) -> None:
        self.dp_rank = dp_rank
        self.send_load = send_load
        self._last: LoadReport | None = None

    def report(
        self, num_running: int, num_waiting: int, memory: dict[str, int], num_received: int
    ) -> None:
        used, _ = token_usage(memory)
        load = LoadReport(
            dp_rank=self.dp_rank,
            num_reqs=num_running + num_waiting,
            num_waiting_reqs=num_waiting,
            num_tokens=used,
            num_received=num_received,
        )
        if load != self._last:
            self._last = load
            self.send_load(load)
