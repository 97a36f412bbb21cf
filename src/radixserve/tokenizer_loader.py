"""The one place a process builds the tokenizer of ``--tokenizer-path`` (or the model path).

A Hugging Face checkpoint directory holds ``tokenizer.json`` and friends; a GGUF file holds its
vocabulary, merges, special tokens and chat template as metadata, from which ``transformers``
builds the same fast tokenizer (``gguf_file=``). Nothing is downloaded. That build parses the
whole vocabulary in Python (9 s for SmolLM2's 49,152 tokens on a 2-core guest) and three
processes of a start need the tokenizer, so the first keeps it in the GGUF cache
(``gguf_cache.py``) as the files ``save_pretrained`` writes, which load in half a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.cache_files import source_digest
from radixserve.gguf_cache import cached
from radixserve.gguf_file import find_gguf


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer`` of a local checkpoint directory or GGUF file."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    gguf = find_gguf(path)
    if gguf is None:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    version = (f"transformers {transformers.__version__} tokenizers {tokenizers.__version__} "
               f"{source_digest(Path(__file__))}")
    return cached(
        gguf, "tokenizer", version,
        lambda: AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name),
        lambda tokenizer, directory: tokenizer.save_pretrained(directory),
        lambda directory: AutoTokenizer.from_pretrained(directory, local_files_only=True),
    )
