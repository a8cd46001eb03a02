"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

They are the dense decoders of ``fw.models.llama`` with the MLP of some or
all layers replaced by a ``SparseMoeBlock``.
"""

from __future__ import annotations

import torch
from torch import nn

from fw.layers.linear import ReplicatedLinear
from fw.layers.moe import FusedMoE
from fw.models.base import HFConfig, ModelContext
from fw.models.llama import GatedMLP, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, qwen_sliding_window


class SparseMoeBlock(nn.Module):
    """Router + routed experts, plus (Qwen2-MoE) a sigmoid-gated shared expert every token goes through."""

    def __init__(
        self,
        config: HFConfig,
        ctx: ModelContext,
        prefix: str,
        *,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        checkpoint_prefix: str | None = None,
        aliases: tuple[tuple[str, tuple[str, str, str]], ...] = (),
        shared_expert_size: int = 0,
    ) -> None:
        """``projections``: each expert's gate, up and down matrices as the checkpoint names them;
        ``checkpoint_prefix``: the block's own name there, when it differs from ``prefix``; ``aliases``: other
        (experts prefix, projections) namings of the same experts."""
        super().__init__()
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {hidden_act!r} (only 'silu')")
        hidden = config.hidden_size
        checkpoint_prefix = checkpoint_prefix or prefix
        self.gate = ReplicatedLinear(
            hidden,
            num_experts,
            bias=False,
            quant=ctx.quant,
            prefix=f"{prefix}.gate",
            params_dtype=ctx.dtype,
            checkpoint_name=f"{checkpoint_prefix}.gate",
        )
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden,
            intermediate_size,
            renormalize=renormalize,
            quant=ctx.quant,
            params_dtype=ctx.dtype,
            prefix=f"{prefix}.experts",
            checkpoint_prefix=f"{checkpoint_prefix}.experts",
            projections=projections,
            aliases=aliases,
        )
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_size:
            self.shared_expert = GatedMLP(
                hidden, shared_expert_size, bias=False, hidden_act=hidden_act, ctx=ctx, prefix=f"{prefix}.shared_expert"
            )
            self.shared_expert_gate = ReplicatedLinear(
                hidden, 1, bias=False, quant=ctx.quant, prefix=f"{prefix}.shared_expert_gate", params_dtype=ctx.dtype
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    decode_graphs = False  # routing reads each expert's token count into Python

    def make_mlp(self, config: HFConfig, ctx: ModelContext, layer_idx: int, prefix: str) -> nn.Module:
        # Mixtral's checkpoint calls the block "block_sparse_moe" and its experts' matrices w1 (gate), w3, w2;
        # checkpoints written through transformers 5's modules (GPTQModel's) say mlp.experts.N.gate_proj etc.
        return SparseMoeBlock(
            config,
            ctx,
            prefix,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            projections=("w1", "w3", "w2"),
            checkpoint_prefix=f"{prefix.removesuffix('.mlp')}.block_sparse_moe",
            aliases=((f"{prefix}.experts", ("gate_proj", "up_proj", "down_proj")),),
        )


def qwen_moe_mlp(
    config: HFConfig, ctx: ModelContext, layer_idx: int, prefix: str, shared_expert_size: int
) -> nn.Module:
    """Experts on every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``; a dense MLP elsewhere."""
    num_experts = config.num_experts
    sparse = (
        layer_idx not in config.get("mlp_only_layers", ())
        and num_experts > 0
        and (layer_idx + 1) % config.get("decoder_sparse_step", 1) == 0
    )
    if not sparse:
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=False,
            hidden_act=config.get("hidden_act", "silu"),
            ctx=ctx,
            prefix=prefix,
        )
    return SparseMoeBlock(
        config,
        ctx,
        prefix,
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=config.get("norm_topk_prob", False),
        shared_expert_size=shared_expert_size,
    )


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    decode_graphs = False  # routing reads each expert's token count into Python

    def attention_bias(self, config: HFConfig) -> tuple[bool, bool]:
        return config.get("qkv_bias", True), False

    def sliding_window(self, config: HFConfig, layer_idx: int) -> int | None:
        # Qwen2-MoE's own rule: even-indexed layers below max_window_layers.
        return qwen_sliding_window(
            config, layer_idx, layer_idx % 2 == 0 and layer_idx < config.get("max_window_layers", 28)
        )

    def make_mlp(self, config: HFConfig, ctx: ModelContext, layer_idx: int, prefix: str) -> nn.Module:
        return qwen_moe_mlp(config, ctx, layer_idx, prefix, config.get("shared_expert_intermediate_size", 0))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decode_graphs = False  # routing reads each expert's token count into Python

    def sliding_window(self, config: HFConfig, layer_idx: int) -> int | None:
        return config.get("sliding_window") if config.get("use_sliding_window", False) else None

    def make_mlp(self, config: HFConfig, ctx: ModelContext, layer_idx: int, prefix: str) -> nn.Module:
        return qwen_moe_mlp(config, ctx, layer_idx, prefix, 0)
