"""Mixture-of-experts layer with stacked expert weights, tensor or expert parallel.

Tensor parallel (the default): every rank holds every expert but only its
slice of each expert's intermediate dimension: ``w13 [E, 2 * I / tp, H]``
(gate rows then up rows) and ``w2 [E, H, I / tp]``. Each rank's output is then
a partial sum, reduced with one all-reduce, exactly like a row-parallel linear
layer.

Expert parallel (``--enable-expert-parallel``): each rank of the EP group holds
``E / ep`` whole experts. Each rank takes its share of the step's tokens, the
comm plugin's ``dispatch`` sends them to the ranks owning their experts and
``combine`` brings the weighted outputs back; an all-gather over the TP group
restores every token on every rank.

The quant method's ``MoEMethod`` owns the parameters' format (``w13_weight``,
``w2_weight`` and whatever scales it needs) and the expert compute; the layer
routes tokens and places checkpoint tensors; the experts' compute shared by
every method is ``fw.sdk.moe``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from fw.distributed import get_ep_group, get_tp_group
from fw.interfaces.quant import MoESpec, QuantMethod
from fw.sdk.linear import divide
from fw.sdk.moe import UnquantizedMoEMethod, select_experts
from fw.sdk.weights import load_shard


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        quant: QuantMethod,
        params_dtype: torch.dtype,
        prefix: str,
        checkpoint_prefix: str,
        projections: tuple[str, str, str],
        aliases: tuple[tuple[str, tuple[str, str, str]], ...] = (),
    ) -> None:
        """``checkpoint_prefix`` / ``projections``: the experts' checkpoint names (see ``MoESpec``); ``aliases``:
        other (prefix, projections) namings some checkpoints use for the same experts."""
        super().__init__()
        self.aliases = aliases
        self.tp = get_tp_group()
        self.ep = get_ep_group()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        if self.ep.world_size > 1:  # whole experts, E / ep of them
            local = divide(num_experts, self.ep.world_size, f"{prefix} experts over the expert-parallel ranks")
            shard_rank, shard_size, width = 0, 1, intermediate_size
        else:
            local = num_experts
            shard_rank, shard_size = self.tp.rank, self.tp.world_size
            width = divide(intermediate_size, self.tp.world_size, f"{prefix} expert width")
        self.first_expert = self.ep.rank * local
        self.spec = MoESpec(
            prefix=prefix,
            num_experts=local,
            hidden_size=hidden_size,
            intermediate_size=width,
            checkpoint_prefix=checkpoint_prefix,
            projections=projections,
            params_dtype=params_dtype,
            tp_rank=shard_rank,
            tp_size=shard_size,
        )
        self.moe_method = quant.get_moe_method(self.spec) or UnquantizedMoEMethod()
        self.moe_method.create_weights(self, self.spec)
        for name, param in self.named_parameters(recurse=False):
            param.weight_loader = partial(self._load_local, getattr(param, "weight_loader", self.weight_loader))
            # Every expert's tensors reach every rank (each keeps its own): counted in global shard ids.
            param.num_shards = (2 if name.startswith("w13_") else 1) * num_experts

    def checkpoint_targets(self) -> Iterator[tuple[str, tuple[str, tuple[int, str]]]]:
        """(checkpoint module name, (parameter name stem, shard_id)): "...experts.3.w1.weight" loads into
        ``w13_weight`` with shard_id (3, "w1"); every expert's, those of other expert-parallel ranks included."""
        spec = self.spec
        for prefix, projections in ((spec.checkpoint_prefix, spec.projections), *self.aliases):
            for e in range(self.num_experts):
                for projection, which in zip(projections, ("w1", "w3", "w2"), strict=True):
                    stem = "w2_" if which == "w2" else "w13_"
                    yield f"{prefix}.{e}.{projection}", (f"{spec.prefix}.{stem}", (e, which))

    def _load_local(self, load: Callable, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """``load`` a tensor of global expert ``shard_id[0]`` as this rank's local expert; another rank's, not at all."""
        expert, which = shard_id
        local = expert - self.first_expert
        if 0 <= local < self.spec.num_experts:
            load(param, loaded, (local, which))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Place one (local) expert's checkpoint tensor; ``shard_id`` is (expert, "w1" | "w3" | "w2")."""
        expert, which = shard_id
        w2 = which == "w2"
        load_shard(
            param.data[expert],
            loaded,
            output_dim=getattr(param, "output_dim", None),
            input_dim=getattr(param, "input_dim", None),
            # w13 stacks gate and up, column-parallel; w2 is row-parallel.
            output_sizes=(1,) if w2 else (1, 1),
            index=0 if which != "w3" else 1,
            output_rank=None if w2 else self.spec.tp_rank,
            input_rank=self.spec.tp_rank if w2 else None,
            what=f"{self.spec.prefix}, expert {expert} {which}",
        )

    def process_weights_after_loading(self) -> None:
        self.moe_method.process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.run(hidden, *select_experts(router_logits, self.top_k, self.renormalize))

    def run(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts on a routing already chosen (architectures with a router of their own, DeepSeek's)."""
        if self.ep.world_size > 1:
            return self._run_expert_parallel(hidden, topk_weights, topk_ids)
        out = self.moe_method.apply(self, hidden, topk_weights, topk_ids)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out

    def _run_expert_parallel(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # The TP ranks hold the same tokens: each sends only its share (padded to equal shares for the gather).
        tokens, share = hidden.shape[0], -(-hidden.shape[0] // self.tp.world_size)
        mine = slice(self.tp.rank * share, (self.tp.rank + 1) * share)
        sent = self.ep.dispatch(hidden[mine], topk_ids[mine], topk_weights[mine], self.num_experts)
        out = self.ep.combine(self.moe_method.apply(self, sent.hidden, sent.topk_weights, sent.topk_ids), sent.handle)
        padded = out.new_zeros(share, out.shape[1])
        padded[: out.shape[0]] = out
        return self.tp.all_gather(padded, dim=0)[:tokens]
