"""Where a safetensors checkpoint's tensors are: its files, for the weight loader, the weight
sync's shape check and the KV-scale reader alike."""

from __future__ import annotations

import json
from pathlib import Path

_INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else every file."""
    model_dir = Path(model_path)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shard files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return files
