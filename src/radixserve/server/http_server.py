"""``launch_server``: the server process from start to clean exit.

Lifecycle::

    bind the port (fail fast) → spawn scheduler + detokenizer (weights load, tqdm on stderr)
    → TokenizerManager + FastAPI app → uvicorn serves (state STARTING: everything but /health
    answers 503) → one warm-up generation → state READY → the ready line on stdout
    → ... → SIGTERM / SIGINT: state DRAINING (/health 503, new requests 503), wait for in-flight
    generations up to DRAIN_TIMEOUT_S, abort the rest, stop uvicorn, stop the children → exit 0.

The ready line ``radixserve ready: http://HOST:PORT (model NAME)`` is the only thing written to
stdout; logs go to stderr.

A machine other than the first (``--node-rank N``) serves no HTTP: it runs its scheduler ranks
until they exit (rank 0's machine ends, and they with it) or until SIGTERM, and prints
``radixserve node N ready`` once they joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from radixserve import startup_gc
from radixserve.managers.launcher import (
    start_subprocesses,
    stop_timeout,
    terminate_processes,
    watch_processes,
)
from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.managers.tokenizer.request_state import RequestMetrics
from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager
from radixserve.model_config import ModelConfig
from radixserve.registry_choices import check_registry_choices
from radixserve.server.app import create_app
from radixserve.server.context import ServerContext, ServerState
from radixserve.server.generations import first_item
from radixserve.server.http_protocol import guarded_protocol
from radixserve.server.metrics import ServerMetrics
from radixserve.server.request_guard import MAX_HEAD_BUFFER
from radixserve.server_args import ServerArgs

logger = logging.getLogger("radixserve.server")

# How long a shutdown waits for in-flight generations before aborting them, and then for the
# aborted ones to end.
DRAIN_TIMEOUT_S = 5.0
ABORT_GRACE_S = 2.0
WARMUP_TIMEOUT_S = 300.0
EXIT_OK, EXIT_FAILURE = 0, 1


class _StopRequested(BaseException):
    """SIGTERM before the server is up: unwinds start-up (children are stopped) and exits 0."""


def launch_server(server_args: ServerArgs) -> int:
    """Run the HTTP server until it is told to stop; return the process exit code.

    Raises ``ValueError`` (bad model or chat template), ``OSError`` (port unavailable) or
    ``RuntimeError`` (a child failed to start) before serving.
    """
    check_registry_choices(server_args)
    chat_template = load_chat_template(server_args.chat_template)
    model_config = ModelConfig.from_path(
        server_args.model_path,
        dtype=server_args.dtype,
        device=server_args.device,
        context_length=server_args.context_length,
        quantization=server_args.quantization,
    )
    if server_args.node_rank > 0:
        return _run_worker_node(server_args)
    sock = bind_socket(server_args.host, server_args.port)
    previous_term = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        return _run(server_args, model_config, chat_template, sock)
    except _StopRequested:
        return EXIT_OK
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, previous_term)


def _run(
    server_args: ServerArgs, model_config: ModelConfig, chat_template: str | None,
    sock: socket.socket,
) -> int:
    """Start the children, serve, and always stop the children again."""
    logger.info("starting radixserve on %s (model %s)", server_args.model_path,
                server_args.model_name)
    port_args, processes, scheduler_info = start_subprocesses(server_args)
    logger.info(
        "KV cache pool: %d tokens; max running requests %s; context length %d; page size %s",
        scheduler_info["max_total_num_tokens"],
        scheduler_info.get("max_running_requests"),
        model_config.context_len,
        scheduler_info.get("page_size"),
    )
    try:
        lifecycle = _Lifecycle(server_args, model_config, scheduler_info, chat_template)
        return asyncio.run(lifecycle.run(port_args, processes, sock))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the clean-up finish
        terminate_processes(processes, stop_timeout(server_args))
        shutil.rmtree(port_args.directory, ignore_errors=True)


def _run_worker_node(server_args: ServerArgs) -> int:
    """Machine N > 0: start this machine's ranks and wait for them (or for SIGTERM)."""
    previous_term = signal.signal(signal.SIGTERM, _raise_stop)
    port_args, processes = None, []
    try:
        port_args, processes, _ = start_subprocesses(server_args)
        print(f"radixserve node {server_args.node_rank} ready", flush=True)
        for proc in processes:
            proc.join()
        codes = [proc.exitcode for proc in processes]
        logger.info("the ranks of node %d exited (codes %s)", server_args.node_rank, codes)
        return EXIT_OK if all(code == 0 for code in codes) else EXIT_FAILURE
    except _StopRequested:
        return EXIT_OK
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        terminate_processes(processes)
        if port_args is not None:
            shutil.rmtree(port_args.directory, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous_term)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, so a busy port fails before the weights load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def server_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _raise_stop(signum: int, frame: Any) -> None:
    raise _StopRequested


def _log_finished_request(m: RequestMetrics) -> None:
    """``--log-requests``: one line per finished request."""
    reason = m.finish_reason.kind if m.finish_reason is not None else None
    e2e = (m.finish_time or m.arrival_time) - m.arrival_time
    logger.info(
        "request %r finished (%s): %d prompt tokens (%d cached), %d output tokens, %.3fs",
        m.rid, reason, m.prompt_tokens, m.cached_tokens, m.completion_tokens, e2e,
    )


class _Server(uvicorn.Server):
    """uvicorn, with SIGINT/SIGTERM routed to our drain instead of its immediate shutdown.

    (uvicorn would also re-raise the captured signal after serving, ending the process with a
    signal status instead of exit code 0.)
    """

    def __init__(self, config: uvicorn.Config, lifecycle: _Lifecycle) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self._lifecycle.on_signal, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)


class _Lifecycle:
    """Warm-up, readiness and graceful shutdown around one uvicorn server."""

    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig,
        scheduler_info: dict[str, Any],
        chat_template: str | None,
    ) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.scheduler_info = scheduler_info
        self.chat_template = chat_template
        self.exit_code = EXIT_OK
        self._drain_task: asyncio.Task | None = None
        self.ctx: ServerContext
        self.server: _Server
        self.app: Any  # the FastAPI app (its batch runner starts once ready)

    async def run(self, port_args: Any, processes: list[Any], sock: socket.socket) -> int:
        args = self.server_args
        tokenizer_manager = TokenizerManager(args, port_args, self.model_config)
        tokenizer_manager.start()
        metrics = ServerMetrics(args.model_name) if args.enable_metrics else None
        hooks = [metrics.on_request_finished] if metrics is not None else []
        if args.log_requests:
            hooks.append(_log_finished_request)
        if hooks:
            tokenizer_manager.on_request_finished = lambda m: [hook(m) for hook in hooks]
        self.ctx = ServerContext(
            server_args=args,
            tokenizer_manager=tokenizer_manager,
            scheduler_info=self.scheduler_info,
            metrics=metrics,
            chat_template=self.chat_template,
        )
        self.app = create_app(self.ctx)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level=args.log_level,
            access_log=args.log_requests,
            lifespan="off",
            timeout_graceful_shutdown=int(ABORT_GRACE_S),
            http=guarded_protocol(args.request_read_timeout),
            h11_max_incomplete_event_size=MAX_HEAD_BUFFER,
        )
        self.server = _Server(config, self)
        loop = asyncio.get_running_loop()
        stop_watch = watch_processes(
            processes, lambda msg: loop.call_soon_threadsafe(self._on_child_death, msg)
        )
        serve_task = asyncio.create_task(self.server.serve(sockets=[sock]))
        warmup_task = asyncio.create_task(self._become_ready(serve_task))
        try:
            await serve_task
        finally:
            stop_watch.set()
            warmup_task.cancel()
            await asyncio.gather(warmup_task, return_exceptions=True)
            await self.app.state.batch_runner.stop()
            self.app.state.batch_runner.store.close()
            tokenizer_manager.shutdown()
        logger.info("server stopped")
        return self.exit_code

    async def _become_ready(self, serve_task: asyncio.Task) -> None:
        """Once uvicorn listens: warm up, switch to READY, print the ready line."""
        while not self.server.started:
            if serve_task.done():
                return
            await asyncio.sleep(0.02)
        if not self.server_args.skip_warmup:
            try:
                await asyncio.wait_for(self._warm_up(), WARMUP_TIMEOUT_S)
            except Exception:
                logger.exception("the warm-up generation failed; shutting down")
                self._stop(EXIT_FAILURE)
                return
        if self.ctx.state is ServerState.STARTING:
            self.ctx.state = ServerState.READY
            url = server_url(self.server_args.host, self.server_args.port)
            print(f"radixserve ready: {url} (model {self.ctx.model_name})", flush=True)
            startup_gc.freeze_and_resume()
            self.app.state.batch_runner.resume()

    async def _warm_up(self) -> None:
        tokenizer_manager = self.ctx.tokenizer_manager
        text, rid = "The capital of France is", f"warmup-{uuid.uuid4().hex}"
        if not tokenizer_manager.is_generation:
            out = await tokenizer_manager.encode_request(GenerateReqInput(text=text, rid=rid))
            logger.info("warm-up embedding done (%d dimensions)", len(out["embedding"]))
            return
        obj = GenerateReqInput(
            text=text, sampling_params={"max_new_tokens": 8, "temperature": 0.0}, rid=rid
        )
        out = await first_item(tokenizer_manager.generate_request(obj))
        logger.info("warm-up generation done (%d tokens)", out["meta_info"]["completion_tokens"])

    def on_signal(self, sig: int) -> None:
        if self._drain_task is None:
            logger.info("received %s: draining", signal.Signals(sig).name)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        elif sig == signal.SIGINT:  # a second Ctrl-C: stop now
            logger.warning("second interrupt: aborting everything and exiting")
            self._abort_all()
            self.server.force_exit = True
            self.server.should_exit = True

    async def _drain(self) -> None:
        """/health turns 503; in-flight generations finish, or are aborted after a timeout."""
        ctx = self.ctx
        ctx.state = ServerState.DRAINING
        if await self._wait_in_flight(DRAIN_TIMEOUT_S):
            logger.warning("aborting %d request(s) still in flight", ctx.in_flight)
            self._abort_all()
            await self._wait_in_flight(ABORT_GRACE_S)
        self.server.should_exit = True

    async def _wait_in_flight(self, timeout: float) -> bool:
        """Wait until no generation is in flight; True if some still are after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.ctx.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.ctx.in_flight > 0

    def _abort_all(self) -> None:
        with contextlib.suppress(RuntimeError):  # the backend may already be gone
            self.ctx.tokenizer_manager.abort_request(abort_all=True)

    def _on_child_death(self, message: str) -> None:
        logger.error("%s; shutting down", message)
        self.ctx.tokenizer_manager.fail_all(message)
        self._stop(EXIT_FAILURE)

    def _stop(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self.ctx.state = ServerState.DRAINING
        self.server.should_exit = True
