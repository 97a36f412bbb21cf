"""The offline engine: the serving processes without HTTP.

``Engine`` starts the child processes (``managers/launcher.py``, as the HTTP server does) and
adds a ``TokenizerManager`` on a private asyncio loop in a background thread, so that plain
synchronous code can call ``generate`` while a caller's own asyncio code can use
``async_generate``::

    caller thread ── run_coroutine_threadsafe ──▶ engine loop thread: TokenizerManager
                                                     │ ZMQ
                                        scheduler process ─▶ detokenizer process

Processes are started with ``spawn``: a script that creates an ``Engine`` at import time must
guard it with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypedDict, Unpack

from radixserve.managers import io_struct
from radixserve.managers.io_struct import OpenSessionReqInput, ProfileReq
from radixserve.managers.ipc import PortArgs
from radixserve.managers.launcher import (
    start_subprocesses,
    stop_timeout,
    terminate_processes,
    watch_processes,
)
from radixserve.managers.tokenizer import lora_client, weight_sync_client
from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager
from radixserve.registry_choices import check_registry_choices
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- engine
_END = object()


class GenerateOptions(TypedDict, total=False):
    """The keyword options of ``Engine.generate`` and ``async_generate`` besides the prompt
    and its sampling parameters (SGLang's names; defaults those of ``GenerateReqInput``)."""

    input_ids: list[int] | list[list[int]] | None  # instead of ``prompt``
    stream: bool
    return_logprob: bool | list[bool]
    top_logprobs_num: int | list[int]
    rid: str | list[str] | None
    session_params: dict[str, Any] | list[dict[str, Any]] | None
    logprob_start_len: int | list[int]
    token_ids_logprob: list[int] | list[list[int]] | None
    return_text_in_logprobs: bool
    data_parallel_rank: int | None  # the replica that runs it (``--dp-size``)
    lora_path: str | list[str | None] | None  # the LoRA adapter by name (docs/lora.md)
    priority: int | None  # with --enable-priority-scheduling (docs/priority.md)


def _generate_req(
    prompt: str | list[str] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    options: GenerateOptions,
) -> GenerateReqInput:
    """The one request builder of ``generate`` and ``async_generate``."""
    unknown = sorted(options.keys() - GenerateOptions.__annotations__.keys())
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
    return GenerateReqInput(text=prompt, sampling_params=sampling_params, **options)


async def _anext(agen: AsyncIterator) -> Any:
    """``__anext__`` as a coroutine that returns ``_END`` instead of raising (futures can't)."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _END


async def _first_and_close(agen: Any) -> Any:
    try:
        return await _anext(agen)
    finally:
        await agen.aclose()


class Engine:
    """Offline inference: ``Engine(model_path=..., **server_args).generate(...)``.

    Outputs are SGLang-shaped dicts ``{"text", "output_ids", "meta_info"}``. Stream chunks are
    cumulative like SGLang's ``/generate``: each carries the whole text and ids so far, and the
    last one has a non-None ``meta_info["finish_reason"]``. A batch stream's chunks carry the
    prompt's ``"index"``.
    """

    def __init__(self, model_path: str | os.PathLike[str], **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - ServerArgs.field_names())
        if unknown:
            raise TypeError(f"unknown Engine argument(s): {', '.join(unknown)}")
        self.server_args = check_registry_choices(
            ServerArgs(model_path=os.fspath(model_path), **kwargs)
        )
        if self.server_args.node_rank != 0:
            raise ValueError(
                "an Engine runs on machine 0; start the other machines' ranks with "
                "`radixserve serve --node-rank N`"
            )
        from radixserve.model_config import ModelConfig

        sa = self.server_args
        self.model_config = ModelConfig.from_path(
            sa.model_path, dtype=sa.dtype, device=sa.device, context_length=sa.context_length,
            quantization=sa.quantization,
        )
        self._closed = False
        self._lock = threading.Lock()
        self._processes: list[mp.process.BaseProcess] = []
        self.tokenizer_manager: TokenizerManager | None = None
        self._stop_watch = threading.Event()
        self.port_args = PortArgs.create()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="radixserve-engine-loop", daemon=True
        )
        self._thread.start()
        # The tokenizer loads on the loop thread while the children start.
        manager_future = self._submit(self._start_tokenizer_manager())
        try:
            _, self._processes, self.scheduler_info = start_subprocesses(sa, self.port_args)
            self.tokenizer_manager = manager_future.result()
        except BaseException:
            try:
                self.tokenizer_manager = manager_future.result()
            except Exception:
                logger.debug("tokenizer manager failed to start", exc_info=True)
            self.shutdown()
            raise
        self._stop_watch = watch_processes(self._processes, self._on_child_death)
        atexit.register(self.shutdown)

    async def _start_tokenizer_manager(self) -> TokenizerManager:
        tokenizer_manager = TokenizerManager(self.server_args, self.port_args, self.model_config)
        tokenizer_manager.start()
        return tokenizer_manager

    def _on_child_death(self, message: str) -> None:
        """From the watchdog thread: make waiting and future calls raise instead of hang."""
        tokenizer_manager = self.tokenizer_manager
        if self._closed or tokenizer_manager is None:
            return
        logger.error(message)
        try:
            self._loop.call_soon_threadsafe(tokenizer_manager.fail_all, message)
        except RuntimeError:  # the loop was closed by a concurrent shutdown
            pass

    @property
    def _live_manager(self) -> TokenizerManager:
        """The tokenizer manager; ``RuntimeError`` once the engine is shut down."""
        if self._closed or self.tokenizer_manager is None:
            raise RuntimeError("the engine is shut down")
        return self.tokenizer_manager

    def _control(self, req: Any) -> Any:
        """Send a control request (``control_client.py``) and wait for the reply to act on;
        ``ValueError`` with the scheduler's reason when it refuses."""
        return self._run(self._live_manager.control.call(req))

    def _submit(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on the engine loop and wait; cancel it if the caller is interrupted."""
        fut = self._submit(coro)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (→ dict) or a batch (→ list); ``stream`` → an iterator.
        The other options are ``GenerateOptions``'.

        Invalid input raises ``ValueError`` here, also for streams (the first chunk is awaited
        before returning). Closing a stream iterator early aborts its unfinished requests.
        """
        obj = _generate_req(prompt, sampling_params, options)
        agen = self._live_manager.generate_request(obj)
        if not obj.stream:
            return self._run(_first_and_close(agen))
        first = self._run(_anext(agen))
        return self._sync_stream(agen, first)

    def _sync_stream(self, agen: Any, first: Any) -> Iterator[dict[str, Any]]:
        item = first
        try:
            while item is not _END:
                yield item
                item = self._run(_anext(agen))
        finally:
            if not self._closed:
                self._run(agen.aclose())

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``generate`` for the caller's own asyncio loop; ``stream`` → an async iterator."""
        obj = _generate_req(prompt, sampling_params, options)
        agen = self._live_manager.generate_request(obj)
        if not obj.stream:
            return await asyncio.wrap_future(self._submit(_first_and_close(agen)))
        first = await asyncio.wrap_future(self._submit(_anext(agen)))
        return self._async_stream(agen, first)

    async def _async_stream(self, agen: Any, first: Any) -> AsyncIterator[dict[str, Any]]:
        item = first
        try:
            while item is not _END:
                yield item
                item = await asyncio.wrap_future(self._submit(_anext(agen)))
        finally:
            if not self._closed:
                await asyncio.wrap_future(self._submit(agen.aclose()))

    # ------------------------------------------------------------------ embeddings
    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embed one input (→ dict) or a batch (→ list): ``{"embedding": [...], "meta_info"}``.

        Needs an embedding model: an encoder checkpoint (BERT) or ``is_embedding=True``.
        """
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, rid=rid)
        return self._run(self._live_manager.encode_request(obj))

    async def async_encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """``encode`` for the caller's own asyncio loop."""
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, rid=rid)
        return await asyncio.wrap_future(self._submit(self._live_manager.encode_request(obj)))

    # ------------------------------------------------------------------ control
    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort a request by id (or all); its generate call ends with finish_reason abort."""

        async def abort() -> None:
            self._live_manager.abort_request(rid, abort_all)

        self._run(abort())

    def flush_cache(self) -> dict[str, Any]:
        """``{"success", "message"}``; refused while requests are running."""
        reply = self._control(io_struct.FlushCacheReq())
        return {"success": reply.success, "message": reply.message}

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop running batches until ``continue_generation``; returns once the pause holds.

        ``abort``: every request ends with finish_reason abort; ``retract``: running requests
        return to the queue and re-prefill later; ``in_place``: they keep their KV and resume.
        New requests queue up meanwhile. ``ValueError`` for another mode.
        """
        self._run(self._live_manager.pause_generation(mode))

    def continue_generation(self) -> None:
        self._control(io_struct.ContinueGenerationReqInput())

    def get_server_info(self) -> dict[str, Any]:
        """The arguments, the sizes the scheduler chose, and each replica's internal state."""
        states = self._run(self._live_manager.control.internal_states())
        return {
            **dataclasses.asdict(self.server_args),
            "max_total_num_tokens": self.scheduler_info["max_total_num_tokens"],
            "context_length": self.scheduler_info["context_len"],
            "internal_states": states,
        }

    # ------------------------------------------------------------------ operations
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a PEFT adapter folder while serving; ``ValueError`` with the reason when
        refused. Returns SGLang's reply: ``success`` and the ``loaded_adapters``."""
        loaded = self._run(lora_client.load_lora_adapter(self._live_manager, lora_name, lora_path))
        return {"success": True, "loaded_adapters": loaded}

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload an adapter; ``ValueError`` while a running or waiting request uses it."""
        loaded = self._run(lora_client.unload_lora_adapter(self._live_manager, lora_name))
        return {"success": True, "loaded_adapters": loaded}

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Swap in the weights at ``model_path`` (same architecture and shapes); new requests
        wait meanwhile, running ones finish first (or are aborted). ``ValueError`` on refusal:
        the old weights keep serving."""
        message = self._run(
            self._live_manager.update_weights_from_disk(model_path, load_format, abort_all_requests)
        )
        return {"success": True, "message": message}

    # ------------------------------------------------------------------ RL weight sync
    # SGLang's calls (docs/weight-sync.md); each returns {"success", "message"} and raises
    # ValueError with the reason on refusal, the old weights serving on.
    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str | None = None,
    ) -> dict[str, Any]:
        """Join a trainer's torch.distributed group (the trainer is rank 0, this engine's ranks
        ``rank_offset`` + rank); blocks until every member has joined. ``backend`` None: gloo
        on CPU, nccl on CUDA."""
        req = io_struct.InitWeightsUpdateGroupReqInput(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend)
        message = self._run(
            weight_sync_client.init_weights_update_group(self._live_manager, req))
        return {"success": True, "message": message}

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = "weight_update_group", flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Receive one broadcast from the trainer (rank 0) per (name, dtype, shape), in order,
        and load them; blocks until all have arrived."""
        req = io_struct.UpdateWeightsFromDistributedReqInput(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
            flush_cache=flush_cache)
        message = self._run(weight_sync_client.update_weights_from_distributed(
            self._live_manager, req, abort_all_requests))
        return {"success": True, "message": message}

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], load_format: str | None = None,
        flush_cache: bool = True, abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Load (checkpoint name, full tensor) pairs, handed to the scheduler ranks in shared
        memory (no file). ``load_format``: None or "auto" only."""
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format {load_format!r} is not supported (None, auto)")
        message = self._run(weight_sync_client.update_weights_from_tensor(
            self._live_manager, list(named_tensors), flush_cache, abort_all_requests))
        return {"success": True, "message": message}

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        message = self._run(
            weight_sync_client.destroy_weights_update_group(self._live_manager, group_name))
        return {"success": True, "message": message}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of checkpoint tensor ``name`` as served."""
        req = io_struct.GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        return self._control(req).parameter

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the KV pool (``kv_cache``) and/or the weights (``weights``; default both);
        generate/encode raise ``ServiceUnavailableError`` until they are resumed."""
        message = self._run(self._live_manager.release_memory_occupation(tags))
        return {"success": True, "message": message}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        message = self._run(self._live_manager.resume_memory_occupation(tags))
        return {"success": True, "message": message}

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> dict[str, Any]:
        """Record a torch.profiler Chrome trace of the scheduler's steps (open it in Perfetto);
        returns its ``trace_path``. With ``num_steps`` it stops by itself."""
        req = ProfileReq(
            action="start", output_dir=output_dir, num_steps=num_steps, activities=activities,
            record_shapes=record_shapes, with_stack=with_stack,
        )
        reply = self._control(req)
        return {"success": True, "message": reply.message, "trace_path": reply.trace_path}

    def stop_profile(self) -> dict[str, Any]:
        reply = self._control(ProfileReq(action="stop"))
        return {"success": True, "message": reply.message, "trace_path": reply.trace_path}

    def set_internal_state(self, server_args: dict[str, Any]) -> dict[str, Any]:
        """Change ``max_running_requests``, ``max_prefill_tokens`` or ``chunked_prefill_size``
        while serving; returns their values now."""
        return self._control(io_struct.SetInternalStateReq(server_args=server_args)).server_args

    def slow_down(self, forward_sleep_time: float | None) -> None:
        """Test hook: every forward step sleeps this many seconds (None: back to normal)."""
        self._control(io_struct.SlowDownReqInput(forward_sleep_time=forward_sleep_time))

    def freeze_gc(self) -> dict[str, int]:
        return self._run(self._live_manager.control.freeze_gc())

    def get_load(self) -> list[dict[str, Any]]:
        return self._run(self._live_manager.control.load())

    def get_inspector_state(self) -> dict[str, Any]:
        """What the ``/dashboard`` page shows: memory, the running batch and the queue, the radix
        tree, sessions and a history of recent steps."""
        return self._control(io_struct.GetInspectorStateReq()).state

    def open_session(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        streaming: bool = False,
        timeout: float | None = None,
        resume: bool = False,
    ) -> str:
        """Open a session (``resume``: a stored streaming session of an earlier run);
        ``ValueError`` with the scheduler's reason when it refuses."""
        req = OpenSessionReqInput(
            capacity_of_str_len=capacity_of_str_len, session_id=session_id,
            streaming=streaming, timeout=timeout, resume=resume,
        )
        return self._run(self._live_manager.open_session(req))

    def close_session(self, session_id: str) -> None:
        self._run(self._live_manager.close_session(session_id))

    # ------------------------------------------------------------------ lifecycle
    @property
    def child_pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    def shutdown(self) -> None:
        """Stop the loop thread and the children, remove the IPC directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        self._stop_watch.set()
        try:
            self._stop_loop()
        finally:
            terminate_processes(self._processes, stop_timeout(self.server_args))
            shutil.rmtree(self.port_args.directory, ignore_errors=True)

    def _stop_loop(self) -> None:
        tokenizer_manager = self.tokenizer_manager
        if tokenizer_manager is not None:

            async def stop_manager() -> None:
                tokenizer_manager.shutdown()
                await asyncio.sleep(0)  # let the cancelled receive task finish

            try:
                asyncio.run_coroutine_threadsafe(stop_manager(), self._loop).result(timeout=10)
            except Exception:  # shutdown goes on: the children must still be stopped
                logger.warning("tokenizer manager did not stop cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
