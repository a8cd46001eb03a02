"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and fine-grained experts with shared ones.

The decoder is Llama's (``fw.models.llama``) with two parts replaced:

- attention (MLA): K and V of every head are expanded from one low-rank
  latent per token (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` ->
  ``kv_b_proj``) plus a rotary key shared by all heads; the KV cache holds
  only the latent and that key. The query has a part without rotary and a
  rotary part, projected directly (``q_proj``, V2-Lite) or through a low-rank
  bottleneck (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``).
- MLP: dense for the first ``first_k_dense_replace`` layers, then routed
  experts plus ``n_shared_experts`` always-on experts. V2 routes on softmax
  scores (optionally top groups first); V3 on sigmoid scores whose
  ``e_score_correction_bias`` steers which experts are chosen but not their
  weights, within the ``topk_group`` best of ``n_group`` expert groups.

Tensor parallel splits the heads (``q_*``, ``kv_b_proj``, ``o_proj``) and the
experts' width like the other models; the latent projection is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fw.interfaces.attention import AttentionLayerSpec, MLADims
from fw.layers.attention import MLAAttention
from fw.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from fw.layers.layernorm import RMSNorm
from fw.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from fw.layers.moe import FusedMoE
from fw.layers.rotary import RotaryEmbedding
from fw.models.base import HFConfig, ModelContext
from fw.models.llama import DecoderLayer, GatedMLP, LlamaForCausalLM, OtherStageLayer

# The low-rank norms take RMSNorm's default epsilon, not rms_norm_eps (as DeepSeek's and transformers' code).
LORA_NORM_EPS = 1e-6


def softmax_scale(config: HFConfig) -> float:
    """1/sqrt(q/k head size), times YaRN's mscale(factor, mscale_all_dim) squared: DeepSeek's long-context
    checkpoints rescale the logits as well as the rotary embedding."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters()
    factor, mscale_all_dim = rope.get("factor") or 1.0, rope.get("mscale_all_dim")
    if rope["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLASelfAttention(nn.Module):
    def __init__(
        self, config: HFConfig, ctx: ModelContext, rotary: RotaryEmbedding, *, layer_idx: int, prefix: str
    ) -> None:
        super().__init__()
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.get("attention_bias", False)
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        q_size = heads * (self.nope + self.rope)
        linear = {"quant": ctx.quant, "params_dtype": ctx.dtype}
        self.q_lora_rank = config.get("q_lora_rank")
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_size, bias=False, prefix=f"{prefix}.q_proj", **linear)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, prefix=f"{prefix}.q_a_proj", **linear)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS, params_dtype=ctx.dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_size, bias=False, prefix=f"{prefix}.q_b_proj", **linear
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.rank + self.rope, bias=bias, prefix=f"{prefix}.kv_a_proj_with_mqa", **linear
        )
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS, params_dtype=ctx.dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.rank, heads * (self.nope + self.v_head_dim), bias=False, prefix=f"{prefix}.kv_b_proj", **linear
        )
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj", **linear)
        self.rotary = rotary
        self.num_heads = self.kv_b_proj.spec.output_sizes[0] // (self.nope + self.v_head_dim)  # on this rank
        spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=1,  # one latent, shared by every head
            head_size=self.nope + self.rope,
            scale=softmax_scale(config),
            layer_idx=layer_idx,
            mla=MLADims(self.rank, self.rope, self.nope, self.v_head_dim),
        )
        self.attn = MLAAttention(spec, ctx.attention)
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV [heads, rank, v_head_dim]): kv_b_proj split per head.

        Read out as kv_b_proj(I), so whatever format its quant method keeps (packed, fp8 blocks) gives the plain
        matrix; taken at the first forward, after the quant method has processed the loaded weight.
        """
        if self.absorbed is None:
            eye = torch.eye(self.rank, dtype=self.kv_a_layernorm.weight.dtype, device=self.kv_a_layernorm.weight.device)
            w = self.kv_b_proj(eye).t().reshape(self.num_heads, self.nope + self.v_head_dim, self.rank)
            self.absorbed = (w[:, : self.nope].contiguous(), w[:, self.nope :].transpose(1, 2).contiguous())
        return self.absorbed

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(num_tokens, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        out = self.attn(q_nope, q_pe, self.kv_a_layernorm(latent), k_pe.squeeze(1), *self.up_projections())
        return self.o_proj(out)


def _keep_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """``scores`` [T, E] with every expert outside the ``topk_group`` best groups set to ``fill``."""
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return scores.masked_fill(~keep.repeat_interleave(scores.shape[1] // keep.shape[1], dim=1), fill)


class DeepseekMoE(nn.Module):
    """Routed experts (DeepSeek's own routing, in float32) plus shared experts that every token goes through."""

    def __init__(self, config: HFConfig, ctx: ModelContext, prefix: str, *, v3: bool) -> None:
        super().__init__()
        self.v3 = v3
        hidden, num_experts = config.hidden_size, config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.get("n_group", 1), config.get("topk_group", 1)
        self.grouped = v3 or config.get("topk_method", "greedy") == "group_limited_greedy"
        if not v3 and config.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{prefix}: unsupported topk_method {config.topk_method!r}")
        self.norm_topk_prob = config.get("norm_topk_prob", False)
        self.routed_scaling_factor = config.get("routed_scaling_factor", 1.0)
        # The router stays float32 whatever the model dtype, as DeepSeek keeps it: near-ties decide experts.
        self.gate = ReplicatedLinear(
            hidden, num_experts, bias=False, quant=ctx.quant, prefix=f"{prefix}.gate", params_dtype=torch.float32
        )
        if v3:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.gate.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.experts = FusedMoE(
            num_experts,
            self.top_k,
            hidden,
            config.moe_intermediate_size,
            renormalize=False,  # unused: routing is ours
            quant=ctx.quant,
            params_dtype=ctx.dtype,
            prefix=f"{prefix}.experts",
            checkpoint_prefix=f"{prefix}.experts",
            projections=("gate_proj", "up_proj", "down_proj"),
        )
        shared = config.get("n_shared_experts", 0)
        self.shared_experts = None
        if shared:
            self.shared_experts = GatedMLP(
                hidden,
                config.moe_intermediate_size * shared,
                bias=False,
                hidden_act=config.get("hidden_act", "silu"),
                ctx=ctx,
                prefix=f"{prefix}.shared_experts",
            )

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [T, top_k], from float32 router logits [T, E]."""
        tokens = logits.shape[0]
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias
            if self.n_group > 1:  # a group's score: the sum of its two best experts
                group_scores = choice.view(tokens, self.n_group, -1).topk(2, dim=-1).values.sum(-1)
                choice = _keep_best_groups(choice, group_scores, self.topk_group, float("-inf"))
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)  # the bias chose; the unbiased scores weigh
        else:
            scores = logits.softmax(dim=-1)
            if self.grouped and self.n_group > 1:  # a group's score: its best expert
                group_scores = scores.view(tokens, self.n_group, -1).amax(dim=-1)
                scores = _keep_best_groups(scores, group_scores, self.topk_group, 0.0)
            weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts.run(hidden, *self.route(self.gate(hidden.float())))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    decode_graphs = False  # routing reads each expert's token count into Python

    v3 = False

    def make_rotary(self, config: HFConfig) -> RotaryEmbedding:
        # DeepSeek's checkpoints rotate interleaved pairs; transformers' V3 also reads rope_interleave=False.
        return RotaryEmbedding(
            config.qk_rope_head_dim,
            config.rope_parameters(),
            config.max_position_embeddings,
            interleaved=config.get("rope_interleave", True),
        )

    def make_attention(
        self, config: HFConfig, ctx: ModelContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> nn.Module:
        return MLASelfAttention(config, ctx, rotary, layer_idx=layer_idx, prefix=prefix)

    def make_mlp(self, config: HFConfig, ctx: ModelContext, layer_idx: int, prefix: str) -> nn.Module:
        moe = (
            config.get("n_routed_experts", 0) > 0
            and layer_idx >= config.get("first_k_dense_replace", 0)
            and layer_idx % config.get("moe_layer_freq", 1) == 0
        )
        if moe:
            return DeepseekMoE(config, ctx, prefix, v3=self.v3)
        return super().make_mlp(config, ctx, layer_idx, prefix)

    def checkpoint_name(self, name: str) -> str | None:
        """The name this model loads the checkpoint tensor ``name`` as; None to skip it. V3 checkpoints append
        multi-token-prediction layers (``model.layers.{num_hidden_layers}...``): the MTP head loads those."""
        parts = name.split(".")
        return None if parts[:2] == ["model", "layers"] and int(parts[2]) >= self.num_layers else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((self.checkpoint_name(name), tensor) for name, tensor in weights)
        return super().load_weights((name, tensor) for name, tensor in renamed if name is not None)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True

    @classmethod
    def mtp_head(cls) -> type[nn.Module]:
        """The model of the checkpoint's multi-token-prediction layer (speculative_config method mtp)."""
        return DeepseekMTP


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (``model.layers.{num_hidden_layers}``): the next token's embedding
    and the previous depth's hidden state, each normed, projected together to the hidden size (``eh_proj``), then a
    decoder layer; ``shared_head`` norms and projects to the vocabulary."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: HFConfig, ctx: ModelContext, prefix: str) -> None:
        super().__init__(self_attn, mlp, config, ctx)
        hidden, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, params_dtype=ctx.dtype)
        self.enorm = RMSNorm(hidden, eps, params_dtype=ctx.dtype)
        self.hnorm = RMSNorm(hidden, eps, params_dtype=ctx.dtype)
        self.eh_proj = ReplicatedLinear(
            2 * hidden, hidden, bias=False, quant=ctx.quant, prefix=f"{prefix}.eh_proj", params_dtype=ctx.dtype
        )
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, params_dtype=ctx.dtype)
        self.shared_head.head = ParallelLMHead(config.vocab_size, hidden, params_dtype=ctx.dtype, quant=ctx.quant)


class DeepseekMTP(DeepseekV3ForCausalLM):
    """The checkpoint's first multi-token-prediction layer as a model of its own, with the checkpoint's names
    (placeholders stand for the decoder layers before it). It derives from the target's class for its layer
    builders and loading only.

    Position p computes token p + 1 (``input_ids``) from the previous depth's hidden state at p: the target's final
    hidden state, or this head's own output when it chains further drafts. The model interface's forward takes ids
    and positions only, so the draft runner sets ``previous_hidden`` [T, hidden] before each forward. The output is
    the layer's hidden state before ``shared_head.norm``, which is what a further depth reads."""

    def __init__(self, config: HFConfig, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.num_layers = n = config.num_hidden_layers
        self.stage = range(n)
        prefix = f"model.layers.{n}"
        rotary = self.make_rotary(config)
        attn = self.make_attention(config, ctx, rotary, n, f"{prefix}.self_attn")
        layer = MTPLayer(attn, self.make_mlp(config, ctx, n, f"{prefix}.mlp"), config, ctx, prefix)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([*(OtherStageLayer() for _ in range(n)), layer])
        self.previous_hidden: torch.Tensor | None = None

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[-1]

    def checkpoint_name(self, name: str) -> str | None:
        # The embedding and head are shared with the target: a checkpoint that stores them once still loads.
        own = f"model.layers.{self.num_layers}."
        shared = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
        if name in shared:
            return own + shared[name]
        return name if name.startswith(own) else None

    def attention_specs(self) -> list[AttentionLayerSpec]:
        return [self.layer.self_attn.attn.spec]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        joined = torch.cat([layer.enorm(layer.embed_tokens(input_ids)), layer.hnorm(self.previous_hidden)], dim=-1)
        hidden, residual = layer(positions, layer.eh_proj(joined), None)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.shared_head.head(self.layer.shared_head.norm(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.layer.shared_head.head.greedy(self.layer.shared_head.norm(hidden))
