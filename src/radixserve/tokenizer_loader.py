"""The one place a process builds the tokenizer of ``--tokenizer-path`` (or the model path).

A Hugging Face checkpoint directory holds ``tokenizer.json`` and friends; a GGUF file holds its
vocabulary, merges, special tokens and chat template as metadata, from which ``transformers``
builds the same fast tokenizer (``gguf_file=``). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.gguf_file import find_gguf


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer`` of a local checkpoint directory or GGUF file."""
    from transformers import AutoTokenizer

    gguf = find_gguf(path)
    if gguf is not None:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
