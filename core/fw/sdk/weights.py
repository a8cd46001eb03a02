"""Weight-loading helpers shared by every layer.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
so that a model's ``load_weights`` never needs to know how a layer shards or
fuses its tensors, and ``num_shards``: how many checkpoint tensors fill it
(3 for a fused q/k/v weight), so that loading can tell a complete parameter
from a partly loaded one.
"""

from __future__ import annotations

from collections.abc import Sequence
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


_PLAIN_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def check_dtype(param: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    """Plain floats convert into one another; anything else (fp8, int8, packed ints) only loads into a
    parameter of its own dtype: a quantized tensor copied into a float parameter would lose its scales
    silently (a quant plugin without a method for that layer, e.g. no ``get_moe_method`` for experts)."""
    if loaded.dtype != param.dtype and not {loaded.dtype, param.dtype} <= _PLAIN_FLOATS:
        where = f" ({what})" if what else ""
        raise ValueError(f"a {str(loaded.dtype).removeprefix('torch.')} checkpoint tensor cannot load into a "
                         f"{str(param.dtype).removeprefix('torch.')} parameter{where}: the quant plugin in use "
                         "does not handle this tensor's format")


def load_shard(
    dst: torch.Tensor,
    loaded: torch.Tensor,
    *,
    output_dim: int | None,
    input_dim: int | None,
    output_sizes: Sequence[int],
    index: int,
    output_rank: int | None,
    input_rank: int | None,
    what: str,
) -> None:
    """Copy one checkpoint sub-matrix (every rank's features) into its place in ``dst``, this rank's slice.

    ``dst`` stacks the sub-matrices of ``output_sizes`` (this rank's sizes) along ``output_dim``; packed
    formats keep fewer rows than logical outputs there, and offsets scale by the same ratio. ``output_rank`` /
    ``input_rank`` say which rank-sized slice of ``loaded`` to take along that dimension (None: not split).
    """
    if output_dim is not None:
        ratio = dst.shape[output_dim] / sum(output_sizes)
        size = round(output_sizes[index] * ratio)
        dst = dst.narrow(output_dim, round(sum(output_sizes[:index]) * ratio), size)
        if output_rank is not None:
            loaded = loaded.narrow(output_dim, output_rank * size, size)
    if input_dim is not None and input_rank is not None:
        size = dst.shape[input_dim]
        loaded = loaded.narrow(input_dim, input_rank * size, size)
    check_shape(dst.shape, loaded, what)
    check_dtype(dst, loaded, what)
    dst.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a replicated (unsharded, unfused) tensor as is."""
    check_shape(param.shape, loaded)
    check_dtype(param, loaded)
    param.data.copy_(loaded)


def num_shards(param: torch.Tensor) -> int:
    return getattr(param, "num_shards", 1)
