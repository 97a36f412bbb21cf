"""Every environment variable radixserve reads, typed, in one place.

Values are read when asked for (not at import), so tests can set them per test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class EnvBool:
    name: str
    default: bool = False

    def get(self) -> bool:
        value = os.environ.get(self.name)
        return self.default if value is None else value.strip().lower() in _TRUE


# Raise instead of only logging when the idle memory self-check finds a leak (set in tests).
RADIXSERVE_TEST_STRICT = EnvBool("RADIXSERVE_TEST_STRICT")
# `radixserve serve` stops (SIGTERM to itself: a clean drain) once its parent process is gone
# (server/parent_watch.py): no orphan server after its launcher was killed (set in tests).
RADIXSERVE_EXIT_WITH_PARENT = EnvBool("RADIXSERVE_EXIT_WITH_PARENT")
# Do not build or use radixserve's own CPU kernels (layers/cpu_kernels.py): torch only.
RADIXSERVE_DISABLE_CPU_KERNELS = EnvBool("RADIXSERVE_DISABLE_CPU_KERNELS")
# Build those kernels for AVX-512 F/BW only, without the BF16, VNNI and AMX instructions this CPU
# may have: the code older AVX-512 CPUs (Skylake, Cascade Lake) run, checked by the tests here.
RADIXSERVE_CPU_KERNELS_AVX512_BASE = EnvBool("RADIXSERVE_CPU_KERNELS_AVX512_BASE")
# Build the kernels an AVX2 CPU without AVX-512 runs (the linear kernel, csrc/avx2/) on a CPU
# that has AVX-512, and use torch for the other ops: checked by the tests on any x86 CPU.
RADIXSERVE_CPU_KERNELS_AVX2 = EnvBool("RADIXSERVE_CPU_KERNELS_AVX2")


@dataclass(frozen=True)
class EnvStr:
    name: str

    def get(self, default: str) -> str:
        return os.environ.get(self.name) or default


# The API keys, for a launch that should not show them in the process list (--api-key and
# --admin-api-key, or --api-key-file and --admin-api-key-file, take precedence).
RADIXSERVE_API_KEY = EnvStr("RADIXSERVE_API_KEY")
RADIXSERVE_ADMIN_API_KEY = EnvStr("RADIXSERVE_ADMIN_API_KEY")
# Where start_profile writes traces when the request names no output_dir (default: the temp dir).
RADIXSERVE_TORCH_PROFILER_DIR = EnvStr("RADIXSERVE_TORCH_PROFILER_DIR")
# Test hook: requests whose rid starts with "inject-fault-" raise inside the scheduler (while it
# handles the message, or while it processes their output), to test that one failing request
# gets a 500 and the others keep running; one whose rid starts with "inject-hang-" hangs its step
# (the watchdog's test: slow_down is bounded by --watchdog-timeout).
RADIXSERVE_TEST_INJECT_FAULTS = EnvBool("RADIXSERVE_TEST_INJECT_FAULTS")
# "busy": check the memory invariant after every scheduler step too (raising on a violation),
# not only when the scheduler goes idle. Costs a little per step; the session tests run with it.
RADIXSERVE_STRICT_MEM_CHECK = EnvStr("RADIXSERVE_STRICT_MEM_CHECK")
# Seconds a request may wait in the scheduler's queue before it first starts; past it the
# request ends with a 503 ("request waiting timeout reached"). Unset or <= 0: no limit.
# SGLang's SGLANG_REQ_WAITING_TIMEOUT (docs/priority.md).
RADIXSERVE_REQ_WAITING_TIMEOUT = EnvStr("RADIXSERVE_REQ_WAITING_TIMEOUT")
# Seconds one step of a request's grammar (its mask, or its advance by a token) may take before
# the request ends with a 400 (constrained/limits.py). Default 0.5.
RADIXSERVE_GRAMMAR_STEP_BUDGET = EnvStr("RADIXSERVE_GRAMMAR_STEP_BUDGET")
# Seconds a request may wait for its grammar to compile before it ends with a 400. Default 300,
# as SGLang's SGLANG_GRAMMAR_TIMEOUT (constrained/limits.py).
RADIXSERVE_GRAMMAR_TIMEOUT = EnvStr("RADIXSERVE_GRAMMAR_TIMEOUT")


def radixserve_cache_dir(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/radixserve/<parts>`` (``~/.cache`` without it): the built kernels, the
    autotune measurements, the GGUF metadata cache."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root.joinpath("radixserve", *parts)
