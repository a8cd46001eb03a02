"""The attention layer: fixed shape (``AttentionLayerSpec``), kernel from the selected backend.

The step's KV caches and backend metadata come from the forward context, so
the layer's signature stays ``forward(q, k, v)``.
"""

from __future__ import annotations

import torch
from torch import nn

from fw.forward_context import get_forward_context
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
        out = self.backend.forward(
            s,
            q.view(num_tokens, s.num_heads, s.head_size),
            k.view(num_tokens, s.num_kv_heads, s.head_size),
            v.view(num_tokens, s.num_kv_heads, s.head_size),
            ctx.kv_caches[s.layer_idx],
            ctx.metadata,
        )
        return out.reshape(num_tokens, s.num_heads * s.head_size)
