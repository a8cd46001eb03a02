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
routes tokens and places checkpoint tensors. ``run_experts`` is the routing
loop every method shares; ``fused_experts``, the unquantized compute, is the
one function a faster kernel (a grouped GEMM, a Triton kernel) replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fw.distributed import get_ep_group, get_tp_group
from fw.interfaces.quant import MoEMethod, MoESpec, QuantMethod
from fw.layers.activation import silu_and_mul
from fw.layers.linear import divide
from fw.layers.utils import load_shard, set_weight_attrs


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k; renormalize them to sum to 1 where the architecture does."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def run_experts(
    hidden: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert(e, hidden[t])`` with ``e = topk_ids[t, k]``; an id of -1 (another rank's
    expert, under expert parallelism) contributes nothing.

    The (token, choice) pairs are sorted by expert so that ``expert(e, rows)`` runs once per expert with work,
    over all of its tokens.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    order = flat_ids.argsort(stable=True)[counts[0]:]  # the -1s sort first
    token_of = order // top_k
    x = hidden[token_of]
    out = torch.empty_like(x)
    start = 0
    for e, count in enumerate(counts[1:]):
        if count:
            rows = slice(start, start + count)
            out[rows] = expert(e, x[rows])
            start += count
    out *= topk_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, token_of, out)


def fused_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * w2[e] @ silu_and_mul(w13[e] @ hidden[t])`` with ``e = topk_ids[t, k]``."""
    return run_experts(
        hidden, topk_weights, topk_ids, w13.shape[0], lambda e, x: F.linear(silu_and_mul(F.linear(x, w13[e])), w2[e])
    )


class UnquantizedMoEMethod(MoEMethod):
    """Experts in the model dtype: ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]``."""

    def create_weights(self, layer: nn.Module, spec: MoESpec) -> None:
        shapes = {
            "w13_weight": (spec.num_experts, 2 * spec.intermediate_size, spec.hidden_size),
            "w2_weight": (spec.num_experts, spec.hidden_size, spec.intermediate_size),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=spec.params_dtype), requires_grad=False)
            set_weight_attrs(param, output_dim=0, input_dim=1)  # of one expert's [out, in] matrix
            layer.register_parameter(name, param)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


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
        self.moe_method = quant.get_moe_method(self.spec)
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
