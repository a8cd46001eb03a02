"""The routed experts' shared compute: expert selection, the routing loop every ``MoEMethod`` runs its experts in,
and the unquantized method (the default of ``QuantMethod.get_moe_method``, and the fallback of quant plugins
for experts they leave in float).

``run_experts`` is the routing loop every method shares; ``fused_experts``, the unquantized compute, is the one
function a faster kernel (a grouped GEMM, a Triton kernel) replaces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fw.interfaces.quant import MoEMethod, MoESpec
from fw.sdk.activation import silu_and_mul
from fw.sdk.weights import set_weight_attrs


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
