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
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import time
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


class LlamaCppGenerator:
    """``generate(prompts, n) -> (outputs, wall_s)``: each prompt decoded greedily for exactly
    ``n`` tokens, one after another (llama-cpp-python runs one sequence per context)."""

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

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
