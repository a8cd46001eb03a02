"""Reading a safetensors checkpoint directory, one shard and one tensor at a time.

Streaming keeps a model larger than host memory's spare room loadable: at most
one tensor is materialised beyond the model's own parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from fw.sdk.errors import CheckpointNotFoundError

if TYPE_CHECKING:
    import torch

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order; every one is checked to exist."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointNotFoundError(f"{index} names shard(s) missing from {model_dir}: {', '.join(missing)}")
        return files
    single = model_dir / SAFETENSORS
    if single.is_file():
        return [single]
    raise CheckpointNotFoundError(f"no {SAFETENSORS} or {SAFETENSORS_INDEX} in {model_dir}")


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, opening one shard at a time."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)
