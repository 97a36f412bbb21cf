"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels' tests run in Triton's interpreter. Triton reads
# TRITON_INTERPRET when it is first imported (its own library's @triton.jit functions, tl.cdiv
# say, are built then), and other test modules import it at collection (through transformers'
# or xgrammar's imports): set here, before any of them, or an interpreted kernel meets a
# compiled library function ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402

from tests.checkpoints import ARCHITECTURES, add_kv_scales, build_checkpoint  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once) and return the path of a tiny checkpoint for ``arch``."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def llama_path(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def calibrated_path(llama_path, tmp_path_factory) -> Path:
    """The tiny Llama checkpoint with a k_scale and a v_scale per layer (``kv_scales_of``), as
    an fp8-KV-calibrated checkpoint carries them."""
    path = tmp_path_factory.mktemp("ckpt-kv-scales")
    shutil.copytree(llama_path, path, dirs_exist_ok=True)
    add_kv_scales(path)
    return path


@pytest.fixture(params=ARCHITECTURES)
def arch_path(request, checkpoint_factory) -> Path:
    return checkpoint_factory(request.param)


# ``make test-quick`` runs what needs no process of its own and is not ``slow`` (a unit test of
# a minute or more). A test is marked ``processes`` when it asks for a fixture that starts a
# server, its folder is one whose tests all start processes (ranks of torch.distributed, the
# soak's server), or its file starts processes itself (a server, an Engine, the launcher's
# children, a subprocess, a spawn context).
PROCESS_FIXTURES = {"server", "client", "api"}
PROCESS_FOLDERS = ("distributed", "reliability")
PROCESS_MARKS = (
    "start_server(", "Engine(", "start_subprocesses", "subprocess", "get_context(", "Popen",
    "run_scheduler_process", "multiprocessing",
)


def pytest_configure(config):
    # Every `radixserve serve` a test starts stops once this pytest process is gone (killed
    # mid-run, say): no orphan servers (server/parent_watch.py).
    os.environ.setdefault("RADIXSERVE_EXIT_WITH_PARENT", "1")
    config.addinivalue_line(
        "markers", "processes: starts server, engine or other processes (left out of test-quick)"
    )
    config.addinivalue_line(
        "markers", "slow: a unit test of a minute or more (left out of test-quick)"
    )


def pytest_collection_modifyitems(config, items):
    sources: dict[Path, bool] = {}
    for item in items:
        path = Path(item.fspath)
        if path not in sources:
            text = path.read_text()
            sources[path] = path.parent.name in PROCESS_FOLDERS or any(
                mark in text for mark in PROCESS_MARKS
            )
        if sources[path] or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
