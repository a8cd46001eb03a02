"""Weight-loading helpers shared by every layer.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
so that a model's ``load_weights`` never needs to know how a layer shards or
fuses its tensors, and ``num_shards``: how many checkpoint tensors fill it
(3 for a fused q/k/v weight), so that loading can tell a complete parameter
from a partly loaded one.
"""

from __future__ import annotations

from typing import Any

import torch


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def check_shape(expected: tuple[int, ...], loaded: torch.Tensor, what: str = "") -> None:
    if tuple(expected) != tuple(loaded.shape):
        where = f" ({what})" if what else ""
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape {tuple(expected)}{where}"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a replicated (unsharded, unfused) tensor as is."""
    check_shape(param.shape, loaded)
    param.data.copy_(loaded)


def num_shards(param: torch.Tensor) -> int:
    return getattr(param, "num_shards", 1)
