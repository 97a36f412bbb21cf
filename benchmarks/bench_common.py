"""What the benchmarks share: the benchmark models by name, torch's thread count, and a
server to measure."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

BENCH_MODELS = ("tiny", "small")
READY_PREFIX = "radixserve ready: "


def resolve_model(name: str) -> str:
    """A checkpoint directory (or GGUF file); the benchmark models are built on first use."""
    from make_bench_models import resolve_model as resolve  # imports torch: only when needed

    return resolve(name)[1]


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Give torch in this process ``threads`` threads (default: leave torch's choice)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Server:
    """``radixserve serve`` in a subprocess on a free loopback port, stopped with SIGTERM.

    ``flags`` are passed to ``radixserve serve`` after ``--model-path`` and ``--port``.
    """

    def __init__(self, model_path: str, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "radixserve", "serve", "--model-path", model_path,
               "--port", str(port), "--log-level", "warning", *flags]
        self.log = tempfile.TemporaryFile("w+")  # the server's stderr, shown if it fails
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._ready = threading.Event()
        threading.Thread(target=self._watch_stdout, daemon=True).start()

    def _watch_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(READY_PREFIX):
                self._ready.set()

    def __enter__(self) -> Server:
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = "".join(self.log.readlines()[-20:])
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{tail}")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
