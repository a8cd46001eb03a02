"""Linear layers, tensor parallel in the Megatron way.

Column-parallel layers split the output features across ranks (no
communication); row-parallel layers split the input features and sum the
partial products with an all-reduce. A column layer followed by a row layer
(q/k/v -> o, gate/up -> down) thus costs one all-reduce.

The layer never owns its weight format: it describes itself in a
``LinearSpec`` (sizes, checkpoint names of its fused sub-matrices, the
tensor-parallel split) and asks the quant method for a ``LinearMethod``, which
registers the parameters and computes the product. The layer only knows how
the checkpoint tensors map onto those parameters, through each parameter's
``output_dim`` / ``input_dim``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fw.distributed import get_tp_group
from fw.interfaces.quant import LinearSpec, QuantMethod
from fw.sdk.linear import divide, load_linear_shard
from fw.sdk.weights import set_weight_attrs


class LinearBase(nn.Module):
    """``output_partition_sizes`` are this rank's sizes of the fused sub-matrices, in checkpoint order;
    ``checkpoint_names`` their module names in the checkpoint (default: ``prefix``, unfused)."""

    def __init__(
        self,
        input_size: int,
        output_partition_sizes: list[int],
        *,
        bias: bool,
        quant: QuantMethod,
        prefix: str,
        params_dtype: torch.dtype,
        checkpoint_names: Sequence[str] | None = None,
        input_is_parallel: bool = False,
        output_is_parallel: bool = False,
        shard_ids: Sequence[Any] | None = None,
        shard_ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        n = len(output_partition_sizes)
        self.spec = LinearSpec(
            prefix=prefix,
            input_size=input_size,
            output_sizes=tuple(output_partition_sizes),
            checkpoint_names=tuple(checkpoint_names or (prefix,)),
            shard_ids=(None,) if shard_ids is None else tuple(shard_ids),
            params_dtype=params_dtype,
            tp_rank=self.tp.rank,
            tp_size=self.tp.world_size,
            input_is_parallel=input_is_parallel,
            output_is_parallel=output_is_parallel,
            shard_ranks=() if shard_ranks is None else tuple(shard_ranks),
        )
        if not len(self.spec.checkpoint_names) == len(self.spec.shard_ids) == n:
            raise ValueError(f"{prefix}: {n} sub-matrices need as many checkpoint names and shard ids")
        self.linear_method = quant.get_linear_method(self.spec)
        self.linear_method.create_weights(self, self.spec)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(output_partition_sizes), dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0, input_dim=None)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            # A quant method may bring its own loader for a packed parameter; keep it.
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader
            param.num_shards = n

    def checkpoint_targets(self) -> Iterator[tuple[str, tuple[str, Any]]]:
        """(checkpoint module name, (parameter name stem, shard_id)) for each sub-matrix: "...q_proj.weight_scale"
        loads into f"{stem}weight_scale" with that shard_id."""
        for name, shard_id in zip(self.spec.checkpoint_names, self.spec.shard_ids, strict=True):
            yield name, (f"{self.spec.prefix}.", shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        load_linear_shard(self.spec, param, loaded, shard_id)

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
        checkpoint_name: str | None = None,
    ) -> None:
        super().__init__(
            input_size,
            [output_size],
            bias=bias,
            quant=quant,
            prefix=prefix,
            params_dtype=params_dtype,
            checkpoint_names=checkpoint_name and [checkpoint_name],
        )


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

    ``checkpoint_names`` names each matrix in the checkpoint; its tensors are loaded with ``shard_id`` = its
    index in ``output_sizes``.
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
        checkpoint_names: Sequence[str],
    ) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(
            input_size,
            [divide(s, tp_size, prefix) for s in output_sizes],
            bias=bias,
            quant=quant,
            prefix=prefix,
            params_dtype=params_dtype,
            checkpoint_names=checkpoint_names,
            output_is_parallel=True,
            shard_ids=range(len(output_sizes)),
        )


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection, split by heads; the checkpoint's three matrices (``checkpoint_names``, in q, k, v
    order) are loaded with ``shard_id`` "q", "k" or "v".

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
        checkpoint_names: Sequence[str],
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
            checkpoint_names=checkpoint_names,
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
