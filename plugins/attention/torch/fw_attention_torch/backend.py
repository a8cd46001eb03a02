"""Paged attention with plain torch ops.

Per step, ``prepare`` turns each request's block table into the cache slots
of its keys, in position order. Per layer, ``forward`` scatters the new K/V
into the cache at ``slot_mapping``, then for each request gathers its keys
and values and runs ``scaled_dot_product_attention``. Query ``j`` of a
request with ``seq_len`` S and ``query_len`` Q sits at position ``S - Q + j``
and sees keys up to its own position (and, with a sliding window W, only the
last W of them). That one rule covers fresh prefill, chunked prefill against
cached context, and decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fw.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayerSpec


@dataclass
class _Request:
    queries: slice  # its rows of the flattened batch
    key_slots: torch.Tensor  # [seq_len] int64: the cache slot of each position
    first_query_pos: int


@dataclass
class TorchAttentionMetadata:
    batch: AttentionBatch
    requests: list[_Request]
    # (request index, sliding window) -> (first visible key, mask or None); layers share them within a step.
    _visible: dict[tuple[int, int | None], tuple[int, torch.Tensor | None]] = field(default_factory=dict)

    def visible_keys(self, i: int, sliding_window: int | None) -> tuple[int, torch.Tensor | None]:
        """The first key position any query of request ``i`` may see, and the [Q, keys] boolean mask
        (None when every query sees every remaining key, as in decode)."""
        cached = self._visible.get((i, sliding_window))
        if cached is None:
            req = self.requests[i]
            seq_len = req.key_slots.shape[0]
            first_key = 0 if sliding_window is None else max(0, req.first_query_pos - sliding_window + 1)
            mask = None
            if seq_len - req.first_query_pos > 1:
                device = req.key_slots.device
                q_pos = torch.arange(req.first_query_pos, seq_len, device=device)[:, None]
                k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
            cached = self._visible[(i, sliding_window)] = (first_key, mask)
        return cached


class TorchAttention(AttentionBackend):
    def prepare(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        block_size = batch.block_size
        offsets = torch.arange(block_size, device=batch.block_tables.device)
        requests = []
        for i in range(batch.num_reqs):
            start, end = batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
            seq_len = batch.seq_lens_cpu[i]
            blocks = batch.block_tables[i, : -(-seq_len // block_size)].long()
            slots = (blocks[:, None] * block_size + offsets).flatten()[:seq_len]
            requests.append(_Request(slice(start, end), slots, seq_len - (end - start)))
        return TorchAttentionMetadata(batch, requests)

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        key_cache = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_size)
        value_cache = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_size)
        slot_mapping = metadata.batch.slot_mapping
        key_cache[slot_mapping] = k
        value_cache[slot_mapping] = v

        out = torch.empty_like(q)
        gqa = layer.num_heads != layer.num_kv_heads
        for i, req in enumerate(metadata.requests):
            first_key, mask = metadata.visible_keys(i, layer.sliding_window)
            slots = req.key_slots[first_key:]
            # [heads, tokens, head_size], the layout sdpa expects.
            keys = key_cache[slots].transpose(0, 1)
            values = value_cache[slots].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q[req.queries].transpose(0, 1), keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=gqa
            )
            out[req.queries] = attn.transpose(0, 1)
        return out
