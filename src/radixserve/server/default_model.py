"""The model ``radixserve serve`` uses when no ``--model-path`` is given.

That is ``models/radixserve-demo``, the small demo checkpoint trained by
``tools/train_demo_model.py`` and shipped with the project, found in the working directory or in
the source checkout this package runs from.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path("models") / "radixserve-demo"


def default_model_path() -> Path:
    """The shipped demo checkpoint; ``ValueError`` when it cannot be found."""
    source_root = Path(__file__).resolve().parents[3]
    candidates = (Path.cwd() / DEMO_MODEL_DIR, source_root / DEMO_MODEL_DIR)
    for candidate in candidates:
        # A checkpoint still being written (no weights yet) does not count.
        if (candidate / "config.json").is_file() and any(candidate.glob("*.safetensors")):
            return candidate
    raise ValueError(
        "no --model-path given and the demo model was not found in "
        + " or ".join(str(c) for c in candidates)
    )
