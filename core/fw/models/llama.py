"""The Llama-style decoder: one implementation for Llama, Mistral, Qwen2 and Qwen3.

Pre-norm decoder layers (RMSNorm -> attention -> RMSNorm -> gated MLP) with
neox RoPE and grouped-query attention. The architectures differ only in
small traits that the subclasses override: attention biases, per-head q/k
RMSNorm (Qwen3), which layers use a sliding window, and the MLP (the MoE
models in ``fw.models.moe`` swap it for experts).

Checkpoint tensors keep their Hugging Face names; ``load_weights`` maps the
separate q/k/v and gate/up matrices onto the fused parameters.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fw.distributed import get_pp_group, stage_layers
from fw.forward_context import get_forward_context
from fw.interfaces.attention import AttentionLayerSpec
from fw.interfaces.model import ModelBase
from fw.layers.attention import Attention
from fw.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from fw.layers.layernorm import RMSNorm
from fw.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fw.layers.rotary import RotaryEmbedding
from fw.models.base import HFConfig, ModelContext
from fw.sdk.activation import SiluAndMul
from fw.sdk.errors import ModelLoadError
from fw.sdk.weights import default_weight_loader, num_shards


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one column-parallel matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool, hidden_act: str, ctx: ModelContext, prefix: str
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {hidden_act!r} (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=bias,
            quant=ctx.quant,
            prefix=f"{prefix}.gate_up_proj",
            params_dtype=ctx.dtype,
            checkpoint_names=[f"{prefix}.gate_proj", f"{prefix}.up_proj"],
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            quant=ctx.quant,
            prefix=f"{prefix}.down_proj",
            params_dtype=ctx.dtype,
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: HFConfig,
        ctx: ModelContext,
        rotary: RotaryEmbedding,
        *,
        layer_idx: int,
        sliding_window: int | None,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_kv_heads,
            bias=qkv_bias,
            quant=ctx.quant,
            prefix=f"{prefix}.qkv_proj",
            params_dtype=ctx.dtype,
            checkpoint_names=[f"{prefix}.{m}_proj" for m in "qkv"],
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.split = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=o_bias,
            quant=ctx.quant,
            prefix=f"{prefix}.o_proj",
            params_dtype=ctx.dtype,
        )
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps, params_dtype=ctx.dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, params_dtype=ctx.dtype) if qk_norm else None
        self.rotary = rotary
        spec = AttentionLayerSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_dim,
            scale=head_dim**-0.5,
            sliding_window=sliding_window,
            layer_idx=layer_idx,
        )
        self.attn = Attention(spec, ctx.attention)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)
        k = k.view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: HFConfig, ctx: ModelContext) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, params_dtype=ctx.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, params_dtype=ctx.dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each add fuses into the following norm.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class OtherStageLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds: no parameters, never run."""


class DecoderModel(nn.Module):
    """The ``model.`` part of the checkpoint: embeddings, decoder layers, final norm.

    Under pipeline parallelism ``layers`` holds this stage's layers (``stage``) among placeholders, so that
    parameter names keep their layer numbers; the stage receives the hidden states and residual stream from the
    previous stage and sends its own to the next without waiting (the runner completes the sends after the step),
    and only the last applies the final norm. Every stage holds the embeddings, final norm and head, so that
    loading and tying stay as they are: their memory is repeated.
    """

    def __init__(self, layers: list[nn.Module], config: HFConfig, ctx: ModelContext, stage: range) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype=ctx.dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6), params_dtype=ctx.dtype)
        self.stage, self.pp, self.dtype, self.hidden_size = stage, get_pp_group(), ctx.dtype, config.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states; on a pipeline stage before the last, its own (which the next stage took)."""
        pp = self.pp
        if pp.rank == 0:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            shape = (input_ids.shape[0], self.hidden_size)
            hidden = pp.recv(torch.empty(shape, dtype=self.dtype, device=input_ids.device), pp.rank - 1)
            residual = pp.recv(torch.empty_like(hidden), pp.rank - 1)
        for layer in self.layers[self.stage.start : self.stage.stop]:
            hidden, residual = layer(positions, hidden, residual)
        if pp.rank < pp.world_size - 1:
            get_forward_context().sends.extend(pp.isend(t, pp.rank + 1) for t in (hidden, residual))
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module, ModelBase):
    """LlamaForCausalLM and MistralForCausalLM (whose ``sliding_window`` applies to every layer)."""

    qk_norm = False
    decode_graphs = True  # a decode step is the same ops on tensors every time (fw.decode_graph)

    def attention_bias(self, config: HFConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o bias)."""
        bias = config.get("attention_bias", False)
        return bias, bias

    def sliding_window(self, config: HFConfig, layer_idx: int) -> int | None:
        return config.get("sliding_window")

    def make_mlp(self, config: HFConfig, ctx: ModelContext, layer_idx: int, prefix: str) -> nn.Module:
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=config.get("mlp_bias", False),
            hidden_act=config.get("hidden_act", "silu"),
            ctx=ctx,
            prefix=prefix,
        )

    def make_rotary(self, config: HFConfig) -> RotaryEmbedding:
        """One rotary embedding that every layer shares."""
        return RotaryEmbedding(config.head_dim, config.rope_parameters(), config.max_position_embeddings)

    def make_attention(
        self, config: HFConfig, ctx: ModelContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> nn.Module:
        qkv_bias, o_bias = self.attention_bias(config)
        return SelfAttention(
            config,
            ctx,
            rotary,
            layer_idx=layer_idx,
            sliding_window=self.sliding_window(config, layer_idx),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self.qk_norm,
            prefix=prefix,
        )

    def __init__(self, config: HFConfig, ctx: ModelContext) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        rotary = self.make_rotary(config)
        self.stage = stage_layers(self.num_layers)
        layers: list[nn.Module] = []
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}"
            if i not in self.stage:
                layers.append(OtherStageLayer())
                continue
            attn = self.make_attention(config, ctx, rotary, i, f"{prefix}.self_attn")
            layers.append(DecoderLayer(attn, self.make_mlp(config, ctx, i, f"{prefix}.mlp"), config, ctx))
        self.model = DecoderModel(layers, config, ctx, self.stage)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=ctx.dtype, quant=ctx.quant)
        if config.get("tie_word_embeddings", False):
            self.lm_head.tie(self.model.embed_tokens)

    def attention_specs(self) -> list[AttentionLayerSpec]:
        """One spec per layer of this pipeline stage, in layer order (``layer_idx`` is the layer's number)."""
        return [layer.self_attn.attn.spec for layer in self.model.layers[self.stage.start : self.stage.stop]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.greedy(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; return the parameters whose every shard was loaded."""
        params = dict(self.named_parameters())
        # Checkpoint module name -> (parameter name stem, shard id), from the layers that fuse or rename
        # checkpoint matrices (q/k/v, gate/up, experts); every other tensor loads into its own name.
        targets = {
            name: target
            for module in self.modules()
            if hasattr(module, "checkpoint_targets")
            for name, target in module.checkpoint_targets()
        }
        seen: dict[str, set[Any]] = defaultdict(set)
        tied = self.config.get("tie_word_embeddings", False)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if layer is not None and layer < self.num_layers and layer not in self.stage:
                continue  # another pipeline stage's
            module, _, leaf = name.rpartition(".")
            stem, shard_id = targets.get(module, (f"{module}.", None))
            target = stem + leaf
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            seen[target].add(shard_id)
        return {name for name, shards in seen.items() if len(shards) >= num_shards(params[name])}


def qwen_sliding_window(config: HFConfig, layer_idx: int, default_sliding: bool) -> int | None:
    """Qwen configs switch the window on with ``use_sliding_window``; transformers 5 configs list
    the sliding layers in ``layer_types``, older ones leave the choice to each family's rule."""
    if not config.get("use_sliding_window", False):
        return None
    layer_types = config.get("layer_types")
    sliding = layer_types[layer_idx] == "sliding_attention" if layer_types else default_sliding
    return config.get("sliding_window") if sliding else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_bias(self, config: HFConfig) -> tuple[bool, bool]:
        return True, False

    def sliding_window(self, config: HFConfig, layer_idx: int) -> int | None:
        return qwen_sliding_window(config, layer_idx, layer_idx >= config.get("max_window_layers", 28))


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    sliding_window = Qwen2ForCausalLM.sliding_window
