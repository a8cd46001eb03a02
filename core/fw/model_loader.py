"""Reading safetensors checkpoints and building a loaded model.

Checkpoints are streamed shard by shard, tensor by tensor, so a model larger
than host memory's spare room still loads: at most one tensor is
materialised beyond the model's own parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from fw.models.base import HFConfig, ModelContext

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A checkpoint could not be turned into a model; the message says what is wrong."""


class CheckpointNotFoundError(ModelLoadError, FileNotFoundError):
    """A checkpoint file (or a shard its index names) is missing."""


class MissingWeightsError(ModelLoadError):
    """The checkpoint left some of the model's parameters unloaded."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"the checkpoint has no weights for {len(names)} parameter(s): {', '.join(names)}")
        self.names = names


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


def resolve_dtype(config: HFConfig, override: str | torch.dtype | None = None) -> torch.dtype:
    """The model dtype: ``override`` if given, else the config's ``dtype`` / ``torch_dtype``, else float32."""
    if isinstance(override, torch.dtype):
        name = str(override).removeprefix("torch.")
    else:
        name = override or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def load_model(
    model_cls: type[nn.Module],
    config: HFConfig,
    ctx: ModelContext,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Construct ``model_cls`` on ``device`` in ``ctx.dtype``, load every parameter, and let each
    linear layer's quant method (and each core layer that has a ``process_weights_after_loading``)
    repack its weights."""
    with torch.device(device):
        model = model_cls(config, ctx)
    loaded = model.load_weights(weights)
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise MissingWeightsError(missing)
    for module in model.modules():
        method: Any = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):  # core layers that repack (the LM head)
            module.process_weights_after_loading()
    return model.eval()
