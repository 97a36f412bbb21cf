"""Running batches (docs/batch.md): each request of a batch goes through the server's own HTTP
app, so it meets exactly the validation, admission and scheduling an HTTP client's request
meets, and its result line holds the very status code and body that client would get.

One asyncio task per live batch moves it through OpenAI's statuses::

    validating → in_progress → finalizing → completed
               ↘ failed (the input file is invalid or gone)
    in_progress → cancelling → cancelled      (POST /v1/batches/{id}/cancel)
    in_progress → expired                     (its 24 hours passed)

At most ``--batch-max-concurrency`` (8) requests of all batches run at once, so a batch never
crowds out interactive requests; with ``--enable-priority-scheduling`` its generations also
carry the least important priority (docs/priority.md), so that any interactive request goes
first and may preempt them. Each finished request's line is appended to the batch's results on
disk at once (``batch_store.py``) and the batch object is saved with its counts, so a restart
loses nothing:
``resume`` picks every unfinished batch up again and runs only the requests with no line yet.
A request cut off by a shutdown leaves no line, so it runs again after the restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from radixserve.managers.caller import may_manage
from radixserve.managers.tokenizer.queue_eviction import EVICTED_MESSAGE, EVICTED_STATUS
from radixserve.server.openai.batch_protocol import (
    TERMINAL,
    BatchLine,
    error_line,
    parse_input,
    result_line,
)
from radixserve.server.openai.batch_store import OWNER, BatchStore

logger = logging.getLogger(__name__)

_RETRY_S = 0.5  # after a 429 (--max-queued-requests reached) or an eviction: retry then
_LEAST_IMPORTANT = {False: -(2**63), True: 2**63 - 1}  # by --schedule-low-priority-values-first


def _evicted(response: httpx.Response) -> bool:
    """Evicted from a full queue by a more important request (docs/priority.md): like a 429,
    the request runs again later rather than failing the line."""
    if response.status_code != EVICTED_STATUS:
        return False
    try:
        return response.json()["error"]["message"] == EVICTED_MESSAGE
    except (ValueError, KeyError, TypeError):
        return False


def _now() -> int:
    return int(time.time())


class BatchRunner:
    """Runs the batches of one server (its app) and keeps their state in ``store``."""

    def __init__(
        self,
        store: BatchStore,
        app: Any,
        server_args: Any,
        accepting: Callable[[], bool],
    ) -> None:
        """``app``: the server's ASGI app; ``accepting``: whether the server takes requests
        (False while it drains: no new request of a batch starts, the batch waits for the
        restart)."""
        self.store = store
        self.server_args = server_args
        self.accepting = accepting
        headers = {"Authorization": f"Bearer {server_args.api_key}"} if server_args.api_key else {}
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://batch", headers=headers,
            timeout=None,
        )
        self.slots = asyncio.Semaphore(server_args.batch_max_concurrency)
        self.tasks: dict[str, asyncio.Task] = {}
        # The batch objects of running batches: the task and the routes share them (a cancel
        # changes the status the task reads), and every change is saved to the store.
        self.live: dict[str, dict] = {}

    def get(self, batch_id: str, caller: str | None = None) -> dict | None:
        """A batch as it is now (live while it runs, else as stored); None when there is none
        or ``caller`` may not see it (``managers/caller.py``; None: unscoped)."""
        batch = self.live.get(batch_id)
        if batch is not None:
            return batch if may_manage(caller, batch.get(OWNER)) else None
        return self.store.batch(batch_id, caller)

    def all(self, caller: str | None = None) -> list[dict]:
        """Every batch ``caller`` may see, newest first."""
        return [self.live.get(b["id"], b) for b in self.store.batches(caller)]

    # ------------------------------------------------------------------ lifecycle
    def resume(self) -> None:
        """Start every batch the store holds unfinished (at start-up)."""
        for batch in self.store.batches():
            if batch["status"] not in TERMINAL:
                logger.info("resuming batch %s (%s)", batch["id"], batch["status"])
                self.start(batch["id"])

    def start(self, batch_id: str) -> None:
        if batch_id not in self.tasks:
            task = asyncio.get_running_loop().create_task(self._run(batch_id))
            self.tasks[batch_id] = task
            task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    async def stop(self) -> None:
        """Stop every batch where it is (their state stays on disk for the next start)."""
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.client.aclose()

    def cancel(self, batch: dict) -> dict:
        """``POST /v1/batches/{id}/cancel``: ``cancelling`` now; the running task stops its
        requests and ends the batch ``cancelled``."""
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=_now())
            self.store.save_batch(batch)
            if batch["id"] not in self.tasks:
                self.start(batch["id"])
        return batch

    # ------------------------------------------------------------------ one batch
    async def _run(self, batch_id: str) -> None:
        batch = self.get(batch_id)
        if batch is None:
            return
        self.live[batch_id] = batch
        try:
            if batch["status"] == "validating":
                lines = self._validate(batch)
                if lines is None:
                    return
            else:
                lines = self._lines(batch)
            if batch["status"] == "in_progress":
                await self._run_requests(batch, lines)
            self._finish(batch, lines)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a fault of ours: the batch fails clearly, the server lives
            logger.exception("batch %s failed", batch_id)
            self._fail(batch, "server_error", f"The batch failed inside the server: {e}")
        finally:
            self.live.pop(batch_id, None)

    def _validate(self, batch: dict) -> list[BatchLine] | None:
        """Parse the input file: ``in_progress`` with its requests, or ``failed``."""
        if self.store.file(batch["input_file_id"]) is None:
            self._fail(batch, "invalid_file", "The input file no longer exists.")
            return None
        lines, errors = parse_input(self.store.file_content(batch["input_file_id"]),
                                    batch["endpoint"])
        if errors:
            batch.update(status="failed", failed_at=_now(),
                         errors={"object": "list", "data": errors})
            self.store.save_batch(batch)
            return None
        if batch["status"] == "validating":  # not cancelled meanwhile
            batch.update(status="in_progress", in_progress_at=_now())
        batch["request_counts"]["total"] = len(lines)
        self.store.save_batch(batch)
        return lines

    def _lines(self, batch: dict) -> list[BatchLine]:
        """A resumed batch's requests (its input file was valid when it started)."""
        if self.store.file(batch["input_file_id"]) is None:
            return []
        lines, _ = parse_input(self.store.file_content(batch["input_file_id"]),
                               batch["endpoint"])
        return lines

    def _fail(self, batch: dict, code: str, message: str) -> None:
        batch.update(status="failed", failed_at=_now(), errors={"object": "list", "data": [
            {"code": code, "message": message, "param": None, "line": None}]})
        self.store.save_batch(batch)

    async def _run_requests(self, batch: dict, lines: list[BatchLine]) -> None:
        """Run every request without a result line yet, ``--batch-max-concurrency`` at a time over
        all batches, until done, cancelled or expired."""
        done = {r["custom_id"] for kind in ("output", "error")
                for r in self.store.read_results(batch["id"], kind)}
        self._count(batch)
        pending = [line for line in lines if line.custom_id not in done]
        running: set[asyncio.Task] = set()
        try:
            for line in pending:
                if not await self._take_slot(batch):
                    break
                task = asyncio.create_task(self._one(batch, line))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(lambda _: self.slots.release())
            while running and not self._should_stop(batch):
                await asyncio.wait(set(running), timeout=1.0)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _take_slot(self, batch: dict) -> bool:
        """Wait for one of the ``--batch-max-concurrency`` slots; False (and no slot) once the
        batch should stop, which is checked while waiting too: the requests holding every slot
        may be this batch's own, held (a paused server) until the cancel stops them."""
        while True:
            if self._should_stop(batch):
                return False
            try:
                await asyncio.wait_for(self.slots.acquire(), timeout=1.0)
            except TimeoutError:
                continue
            if not self._should_stop(batch):
                return True
            self.slots.release()
            return False

    def _should_stop(self, batch: dict) -> bool:
        """Cancelled, expired, or the server drains."""
        return (batch["status"] == "cancelling" or _now() >= batch["expires_at"]
                or not self.accepting())

    async def _one(self, batch: dict, line: BatchLine) -> None:
        body = dict(line.body)
        if self.server_args.enable_priority_scheduling and batch["endpoint"] != "/v1/embeddings":
            low_first = self.server_args.schedule_low_priority_values_first
            body.setdefault("priority", _LEAST_IMPORTANT[low_first])
        if body.get("stream"):
            status, reply = 400, {"error": {
                "message": "stream is not supported in a batch request", "type":
                "invalid_request_error", "param": "stream", "code": None}}
        else:
            while True:
                response = await self.client.post(batch["endpoint"], json=body)
                if response.status_code != 429 and not _evicted(response):
                    break
                await asyncio.sleep(_RETRY_S)
            if not 200 <= response.status_code < 300 and not self.accepting():
                return  # cut off by a shutdown: runs again after the restart
            status = response.status_code
            try:
                reply = response.json()
            except json.JSONDecodeError:
                reply = {"error": {"message": response.text[:2000], "type": "server_error"}}
        kind = "output" if 200 <= status < 300 else "error"
        self.store.append_result(batch["id"], kind, result_line(line.custom_id, status, reply))
        batch["request_counts"]["completed" if kind == "output" else "failed"] += 1
        self.store.save_batch(batch)

    def _count(self, batch: dict) -> None:
        counts = batch["request_counts"]
        counts["completed"] = len(self.store.read_results(batch["id"], "output"))
        counts["failed"] = len(self.store.read_results(batch["id"], "error"))

    def _finish(self, batch: dict, lines: list[BatchLine]) -> None:
        """Write the output and error files and end the batch (unless the server drains: then
        it stays as it is for the restart)."""
        if batch["status"] in TERMINAL:
            return
        if batch["status"] == "cancelling":
            final = {"status": "cancelled", "cancelled_at": _now()}
        elif _now() >= batch["expires_at"]:
            done = {r["custom_id"] for kind in ("output", "error")
                    for r in self.store.read_results(batch["id"], kind)}
            for line in lines:
                if line.custom_id not in done:
                    self.store.append_result(batch["id"], "error", error_line(
                        line.custom_id, "batch_expired",
                        "This request could not be executed before the completion window "
                        "expired."))
            final = {"status": "expired", "expired_at": _now()}
        elif not self.accepting():
            return
        else:
            batch.update(status="finalizing", finalizing_at=_now())
            self.store.save_batch(batch)
            final = {"status": "completed", "completed_at": _now()}
        for kind, field in (("output", "output_file_id"), ("error", "error_file_id")):
            path = self.store.results_path(batch["id"], kind)
            if path.exists() and path.stat().st_size:
                meta = self.store.add_file(path.read_bytes(), f"{batch['id']}_{kind}.jsonl",
                                           "batch_output", _now(), batch.get(OWNER))
                batch[field] = meta["id"]
        self._count(batch)
        batch.update(final)
        self.store.save_batch(batch)
