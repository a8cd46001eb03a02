"""Linear layers, tensor parallel in the Megatron way.

Column-parallel layers split the output features across ranks (no
communication); row-parallel layers split the input features and sum the
partial products with an all-reduce. A column layer followed by a row layer
(q/k/v -> o, gate/up -> down) thus costs one all-reduce.

The layer never owns its weight format: it asks the quant method for a
``LinearMethod`` by prefix, which registers the parameters and computes the
product. The layer only knows how the checkpoint tensors map onto those
parameters, through each parameter's ``output_dim`` / ``input_dim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fw.distributed import get_tp_group
from fw.interfaces.quant import QuantMethod
from fw.layers.utils import check_shape, set_weight_attrs


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):
    """``output_partition_sizes`` are this rank's sizes of the fused sub-matrices, in checkpoint order."""

    def __init__(
        self,
        input_size: int,
        output_partition_sizes: list[int],
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
        input_is_parallel: bool = False,
        output_is_parallel: bool = False,
        shard_ids: Sequence[Any] | None = None,
        shard_ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.prefix = prefix
        self.input_size = input_size
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size = sum(self.output_partition_sizes)
        self.input_is_parallel = input_is_parallel
        self.output_is_parallel = output_is_parallel
        n = len(self.output_partition_sizes)
        self.shard_ids = tuple(range(n)) if shard_ids is None else tuple(shard_ids)
        # Which rank-sized slice of each checkpoint shard this rank holds (differs from the
        # rank when KV heads are replicated across ranks).
        self.shard_ranks = [self.tp.rank] * n if shard_ranks is None else list(shard_ranks)

        self.linear_method = quant.get_linear_method(prefix)
        self.linear_method.create_weights(self, input_size, self.output_partition_sizes, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0, input_dim=None)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            # A quant method may bring its own loader for a packed parameter; keep it.
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader
            param.num_shards = n

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None and len(self.shard_ids) > 1:
            raise ValueError(f"{self.prefix} fuses {self.shard_ids}: each checkpoint tensor needs its shard_id")
        idx = 0 if shard_id is None else self.shard_ids.index(shard_id)
        dst = param.data
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            # Packed formats keep fewer rows than logical outputs; offsets scale by the same ratio.
            ratio = dst.shape[output_dim] / self.output_size
            start = round(sum(self.output_partition_sizes[:idx]) * ratio)
            size = round(self.output_partition_sizes[idx] * ratio)
            dst = dst.narrow(output_dim, start, size)
            if self.output_is_parallel:
                loaded = loaded.narrow(output_dim, self.shard_ranks[idx] * size, size)
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None and self.input_is_parallel:
            size = dst.shape[input_dim]
            loaded = loaded.narrow(input_dim, self.tp.rank * size, size)
        check_shape(dst.shape, loaded, f"{self.prefix}, shard {shard_id}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The full matrix on every rank (MoE routers, small gates)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__(input_size, [output_size], bias=bias, quant=quant, prefix=prefix, params_dtype=params_dtype)


class ColumnParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
    ) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(
            input_size,
            [divide(output_size, tp_size, prefix)],
            bias=bias,
            quant=quant,
            prefix=prefix,
            params_dtype=params_dtype,
            output_is_parallel=True,
        )


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices of the same input fused into one product (gate and up).

    Checkpoint tensors are loaded with ``shard_id`` = their index in ``output_sizes``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
    ) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(
            input_size,
            [divide(s, tp_size, prefix) for s in output_sizes],
            bias=bias,
            quant=quant,
            prefix=prefix,
            params_dtype=params_dtype,
            output_is_parallel=True,
        )


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection, split by heads; loaded with ``shard_id`` "q", "k" or "v".

    With fewer KV heads than ranks each rank holds one KV head, shared by
    ``tp_size / num_kv_heads`` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
    ) -> None:
        tp = get_tp_group()
        num_heads = divide(total_num_heads, tp.world_size, f"{prefix} attention heads")
        if total_num_kv_heads >= tp.world_size:
            num_kv_heads = divide(total_num_kv_heads, tp.world_size, f"{prefix} KV heads")
            kv_rank = tp.rank
        else:
            replicas = divide(tp.world_size, total_num_kv_heads, f"{prefix} ranks per KV head")
            num_kv_heads, kv_rank = 1, tp.rank // replicas
        q, kv = num_heads * head_size, num_kv_heads * head_size
        super().__init__(
            hidden_size,
            [q, kv, kv],
            bias=bias,
            quant=quant,
            prefix=prefix,
            params_dtype=params_dtype,
            output_is_parallel=True,
            shard_ids=("q", "k", "v"),
            shard_ranks=[tp.rank, kv_rank, kv_rank],
        )
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size


class RowParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
    ) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(
            divide(input_size, tp_size, prefix),
            [output_size],
            bias=bias,
            quant=quant,
            prefix=prefix,
            params_dtype=params_dtype,
            input_is_parallel=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x)
        if self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        # The bias is added once, after the partial products are summed.
        return out if self.bias is None else out + self.bias
