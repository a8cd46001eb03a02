"""The attention layer: fixed shape (``AttentionLayerSpec``), kernel from the selected backend.

The step's KV caches and backend metadata come from the forward context, so
the layer's signature stays ``forward(q, k, v)`` (``MLAAttention``: the query
parts, the latent and the rotary key, see ``AttentionBackend.forward_mla``).
"""

from __future__ import annotations

import torch
from torch import nn

from fw.forward_context import get_forward_context, save_kv_layer, wait_for_kv_layer
from fw.interfaces.attention import AttentionBackend, AttentionLayerSpec


class Attention(nn.Module):
    def __init__(self, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads * head_size], k and v [T, kv_heads * head_size] -> [T, heads * head_size]."""
        ctx = get_forward_context()
        s = self.spec
        num_tokens = q.shape[0]
        wait_for_kv_layer(s.layer_idx)
        out = self.backend.forward(
            s,
            q.view(num_tokens, s.num_heads, s.head_size),
            k.view(num_tokens, s.num_kv_heads, s.head_size),
            v.view(num_tokens, s.num_kv_heads, s.head_size),
            ctx.kv_caches[s.layer_idx],
            ctx.metadata,
        )
        save_kv_layer(s.layer_idx)
        return out.reshape(num_tokens, s.num_heads * s.head_size)


class MLAAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2/V3): the backend caches the latent, not per-head K and V."""

    def forward(  # type: ignore[override]
        self,
        q_nope: torch.Tensor,  # [T, heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [T, heads, qk_rope_head_dim]
        kv_latent: torch.Tensor,  # [T, kv_lora_rank]
        k_pe: torch.Tensor,  # [T, qk_rope_head_dim]
        w_uk: torch.Tensor,  # [heads, qk_nope_head_dim, kv_lora_rank]
        w_uv: torch.Tensor,  # [heads, kv_lora_rank, v_head_dim]
    ) -> torch.Tensor:
        """-> [T, heads * v_head_dim]."""
        ctx = get_forward_context()
        s = self.spec
        wait_for_kv_layer(s.layer_idx)
        out = self.backend.forward_mla(
            s, q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, ctx.kv_caches[s.layer_idx], ctx.metadata
        )
        save_kv_layer(s.layer_idx)
        return out.reshape(q_nope.shape[0], s.num_heads * s.mla.v_head_dim)
