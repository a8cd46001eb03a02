"""Mixture-of-experts layer with stacked expert weights, tensor parallel over the expert MLP width.

Every rank holds every expert but only its slice of each expert's
intermediate dimension: ``w13 [E, 2 * I / tp, H]`` (gate rows then up rows)
and ``w2 [E, H, I / tp]``. Each rank's output is then a partial sum, reduced
with one all-reduce, exactly like a row-parallel linear layer.

All expert compute goes through the module-level ``fused_experts``, the one
function a faster kernel (a grouped GEMM, a Triton kernel) replaces.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from fw.distributed import get_tp_group
from fw.layers.activation import silu_and_mul
from fw.layers.linear import divide
from fw.layers.utils import check_shape

# Per-expert checkpoint names: Qwen's gate_proj/up_proj/down_proj and Mixtral's w1/w3/w2.
_EXPERT_WEIGHT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.weight$"
)
_SHARD = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """Map ``...experts.{e}.{proj}.weight`` to (stacked parameter name, (e, "w1" | "w3" | "w2"))."""
    m = _EXPERT_WEIGHT.match(name)
    if m is None:
        return None
    shard = _SHARD[m["proj"]]
    return f"{m['prefix']}.{'w2' if shard == 'w2' else 'w13'}", (int(m["expert"]), shard)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k; renormalize them to sum to 1 where the architecture does."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * w2[e] @ silu_and_mul(w13[e] @ hidden[t])`` with ``e = topk_ids[t, k]``.

    The (token, choice) pairs are sorted by expert so that each expert with
    work runs one pair of matmuls over all of its tokens.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    x = hidden[token_of]
    out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()):
        if count:
            rows = slice(start, start + count)
            out[rows] = F.linear(silu_and_mul(F.linear(x[rows], w13[expert])), w2[expert])
            start += count
    out *= topk_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, token_of, out)


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        params_dtype: torch.dtype,
        prefix: str,
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_per_rank = divide(intermediate_size, self.tp.world_size, f"{prefix} expert width")
        width = self.intermediate_per_rank
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * width, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, width, dtype=params_dtype), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.w13.num_shards, self.w2.num_shards = 2 * num_experts, num_experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Place one expert's checkpoint matrix; ``shard_id`` is (expert, "w1" | "w3" | "w2")."""
        expert, which = shard_id
        width = self.intermediate_per_rank
        mine = slice(self.tp.rank * width, (self.tp.rank + 1) * width)
        if which == "w2":
            dst, src = param.data[expert], loaded[:, mine]
        else:
            half = 0 if which == "w1" else 1
            dst, src = param.data[expert, half * width : (half + 1) * width], loaded[mine]
        check_shape(dst.shape, src, f"expert {expert} {which}")
        dst.copy_(src)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out
