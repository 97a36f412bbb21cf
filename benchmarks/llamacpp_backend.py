"""llama.cpp as a benchmark backend: the same checkpoint converted to GGUF by llama.cpp's own
converter, run through ``llama-cpp-python``.

- The converter (``convert_hf_to_gguf.py``, with the ``gguf`` package of the same release) ships
  in the ``llama-cpp-python`` source distribution; it is fetched once with ``pip download``
  (the installed version) into ``~/.cache/radixserve/llama.cpp``. ``LLAMA_CPP_DIR`` points at
  an existing llama.cpp checkout instead.
- The benchmark checkpoints use a tokenizer trained here, whose pre-tokenizer llama.cpp's
  table does not list; the converter then stops. Prompts go to llama.cpp as token ids, so the
  pre-tokenizer name does not matter: it is written as ``default``.
- GGUF files are cached next to the checkpoint's name under ``~/.cache/radixserve/bench/gguf``
  (``bf16`` or ``q8_0``, llama.cpp's int8 format: blocks of 32 weights with one scale).

Install: ``pip install llama-cpp-python`` (it builds llama.cpp for this CPU, about 7 minutes).

AMX: a build for an AMX CPU (``AMX_INT8 = 1`` in llama.cpp's system info) puts Q4_0/Q4_1/Q8_0
weights in its AMX buffer type, whose kernels die of SIGILL on the first tile instruction on the
2-vCPU KVM guest of benchmarks/RESULTS.md (llama-cpp-python 0.3.36; the tile state is not made
usable for the threads that run them, llama.cpp PR #26954). Such a build then runs without its
extra buffer types (``use_extra_bufts = false``, which also drops the CPU repacking of the few
types that have it); a build without AMX keeps them::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" \
      pip install --force-reinstall --no-deps llama-cpp-python
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

CACHE = Path.home() / ".cache" / "radixserve"
OUTTYPES = ("bf16", "q8_0")

# Runs the converter with the pre-tokenizer check answering "default" (see the docstring).
_CONVERT = """
import runpy, sys
sys.path.insert(0, {root!r})
sys.path.insert(1, {gguf!r})
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def llama_cpp_source() -> Path:
    """A llama.cpp tree holding ``convert_hf_to_gguf.py``: ``LLAMA_CPP_DIR``, or the vendored
    copy in the installed llama-cpp-python's source distribution (downloaded once)."""
    if os.environ.get("LLAMA_CPP_DIR"):
        return Path(os.environ["LLAMA_CPP_DIR"])
    version = importlib.metadata.version("llama-cpp-python")
    root = CACHE / "llama.cpp" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    target = CACHE / "llama.cpp"
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
         "--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(target)],
        check=True,
    )
    with tarfile.open(target / f"llama_cpp_python-{version}.tar.gz") as tar:
        tar.extractall(target, filter="data")
    return root


def convert(model_path: str, label: str, outtype: str) -> Path:
    """The GGUF file of ``model_path`` in ``outtype`` (converted on first use)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"llama.cpp outtype must be one of {OUTTYPES}, got {outtype!r}")
    out = CACHE / "bench" / "gguf" / f"{label}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    root = llama_cpp_source()
    code = _CONVERT.format(
        root=str(root), gguf=str(root / "gguf-py"), script=str(root / "convert_hf_to_gguf.py"),
        args=[model_path, "--outtype", outtype, "--outfile", str(out)],
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ,
                                                                  "NO_LOCAL_GGUF": "1"})
    return out


def system_info() -> str:
    """llama.cpp's own line of the CPU features it was built with (``AVX512 = 1 | ...``)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


@contextlib.contextmanager
def _extra_bufts(enabled: bool) -> Iterator[None]:
    """Models loaded inside get ``use_extra_bufts = enabled``; llama-cpp-python's ``Llama`` has
    no argument for this field of llama.cpp's model parameters, so their defaults are wrapped
    while the model loads."""
    import llama_cpp.llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params

    def params():  # a ctypes struct
        p = defaults()
        p.use_extra_bufts = enabled
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


class LlamaCppGenerator:
    """``generate(prompts, n) -> (outputs, wall_s)``: each prompt decoded greedily for exactly
    ``n`` tokens, one after another (llama-cpp-python runs one sequence per context)."""

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.system_info = system_info()
        # the AMX buffer type's kernels crash here (see the module docstring)
        self.extra_bufts = "AMX_INT8 = 1" not in self.system_info
        with _extra_bufts(self.extra_bufts):
            self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                             n_threads_batch=threads, n_batch=512, verbose=False)

    def generate(self, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        import llama_cpp

        outputs = []
        llama_cpp.llama_perf_context_reset(self.llm._ctx.ctx)
        start = time.perf_counter()
        for prompt in prompts:
            self.llm.reset()
            tokens: list[int] = []
            for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                tokens.append(token)
                if len(tokens) == n:
                    break
            outputs.append(tokens)
        return outputs, time.perf_counter() - start

    def perf(self) -> dict[str, float]:
        """llama.cpp's own timing of the last ``generate``: its prompt and decode calls
        (``llama_perf_context``), without llama-cpp-python's Python loop and sampling."""
        import llama_cpp

        data = llama_cpp.llama_perf_context(self.llm._ctx.ctx)
        return {"prompt_tokens": data.n_p_eval, "prompt_ms": round(data.t_p_eval_ms, 2),
                "decode_tokens": data.n_eval, "decode_ms": round(data.t_eval_ms, 2),
                "decode_tokens_per_s": round(1000 * data.n_eval / max(data.t_eval_ms, 1e-9), 1)}
