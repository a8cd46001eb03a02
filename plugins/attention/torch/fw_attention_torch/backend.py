"""Paged attention with plain torch ops.

Per step, ``prepare`` turns each request's block table into the cache slots
of its keys, in position order. Per layer, ``forward`` scatters the new K/V
into the cache at ``slot_mapping`` and then attends:

- requests with several new tokens (prefill, or a prefill chunk on top of
  cached context) one at a time with ``scaled_dot_product_attention``;
- all one-token requests (decode) together. On the CPU a native kernel
  (``csrc/paged_decode.cpp``, built on first use) reads their keys and values
  block by block where they lie in the cache; elsewhere, or without a
  compiler, one batched product over their keys gathered and padded to the
  longest (per-request calls would cost more in call overhead than in
  arithmetic). The gather alone cost more than the whole native kernel.

Query ``j`` of a request with ``seq_len`` S and ``query_len`` Q sits at
position ``S - Q + j`` and sees the keys up to its own position (with a
sliding window W, only the last W of them). That one rule covers fresh
prefill, chunked prefill against cached context, and decode.

Every KV-cache dtype of ``fw.kv_quant`` is read by both paths: the torch path
dequantizes the keys and values it gathers, the native kernel each row as it
reads it.

Multi-head latent attention (``forward_mla``) caches one row per token, the
latent and the rotary key. Prefill rows expand the cached latents to every
head's K and V and attend as above; decodes never expand them: W_UK folds into
the query and W_UV into the output, so each step reads the latent rows once
(DeepSeek-V2's "absorbed" form).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from fw import kv_quant, native
from fw.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayerSpec

_NATIVE_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@dataclass
class _Prefill:
    queries: slice  # its rows of the flattened batch
    key_slots: torch.Tensor  # [seq_len] int64: the cache slot of each position
    first_query_pos: int


@dataclass
class _Decodes:
    rows: torch.Tensor  # [D] each decode request's query row
    seq_lens: torch.Tensor  # [D] int32
    block_tables: torch.Tensor | None  # [D, max_blocks] int32, for the native kernel
    key_slots: torch.Tensor | None  # [D, max_len] cache slots, padded (masked out), for the torch path


@dataclass
class TorchAttentionMetadata:
    batch: AttentionBatch
    prefills: list[_Prefill]
    decodes: _Decodes | None
    # Masks depend on the layer only through its sliding window: built once per step and window.
    _masks: dict[tuple[int, int | None], tuple[int, torch.Tensor | None]] = field(default_factory=dict)

    def prefill_mask(self, i: int, sliding_window: int | None) -> tuple[int, torch.Tensor | None]:
        """The first key position any query of prefill ``i`` sees, and the [Q, keys] boolean mask."""
        key = (i, sliding_window)
        if key not in self._masks:
            req = self.prefills[i]
            seq_len = req.key_slots.shape[0]
            first_key = 0 if sliding_window is None else max(0, req.first_query_pos - sliding_window + 1)
            device = req.key_slots.device
            q_pos = torch.arange(req.first_query_pos, seq_len, device=device)[:, None]
            k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            self._masks[key] = (first_key, mask)
        return self._masks[key]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[D, max_len] boolean: which padded key columns each decode request sees."""
        key = (-1, sliding_window)
        if key not in self._masks:
            seq_lens = self.decodes.seq_lens[:, None]
            k_pos = torch.arange(self.decodes.key_slots.shape[1], device=seq_lens.device)[None, :]
            mask = k_pos < seq_lens
            if sliding_window is not None:
                mask &= k_pos >= seq_lens - sliding_window
            self._masks[key] = (0, mask)
        return self._masks[key][1]


def _capped(scores: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """Scores under the layer's logit soft cap, if it has one (Gemma 2): cap * tanh(scores / cap)."""
    cap = layer.logits_soft_cap
    return scores if not cap else cap * torch.tanh(scores / cap)


def _capped_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    layer: AttentionLayerSpec) -> torch.Tensor:
    """sdpa's product for [1, heads, Q, D] queries over [1, kv_heads, S, D] keys and values, with the soft cap."""
    group = layer.num_heads // layer.num_kv_heads
    keys, values = (t.float().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = _capped(q.float() @ keys.transpose(-1, -2) * layer.scale, layer)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)


class TorchAttention(AttentionBackend):
    def native_decode(self, device: torch.device) -> bool:
        return device.type == "cpu" and native.load("fw_attention_torch", _NATIVE_SOURCE)

    def prepare(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        block_size = batch.block_size
        device = batch.block_tables.device
        offsets = torch.arange(block_size, device=device)
        starts, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu

        def slots(i: int, length: int) -> torch.Tensor:
            blocks = batch.block_tables[i, : -(-length // block_size)].long()
            return (blocks[:, None] * block_size + offsets).flatten()[:length]

        prefills, decode_reqs = [], []
        for i in range(batch.num_reqs):
            query_len = starts[i + 1] - starts[i]
            if query_len == 1:
                decode_reqs.append(i)
            else:
                prefills.append(
                    _Prefill(slice(starts[i], starts[i + 1]), slots(i, seq_lens[i]), seq_lens[i] - query_len)
                )
        decodes = None
        if decode_reqs:
            index = torch.tensor(decode_reqs, device=device)
            rows = batch.query_start_loc[:-1][index].long()
            if self.native_decode(device):
                decodes = _Decodes(rows, batch.seq_lens[index], batch.block_tables[index], None)
            else:
                max_len = max(seq_lens[i] for i in decode_reqs)
                # Padded columns repeat the request's first key: masked out, but never unwritten (NaN) cache
                # memory, which would poison the probabilities-times-values product.
                padded = []
                for i in decode_reqs:
                    own = slots(i, seq_lens[i])
                    padded.append(torch.cat([own, own[:1].expand(max_len - seq_lens[i])]))
                decodes = _Decodes(rows, batch.seq_lens[index], None, torch.stack(padded))
        return TorchAttentionMetadata(batch, prefills, decodes)

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_quant.write_kv(kv_cache, metadata.batch.slot_mapping, k, v, layer)

        decodes = metadata.decodes
        native = decodes is not None and decodes.block_tables is not None
        if native and not metadata.prefills:  # a decode-only step: every row is a decode, in order
            return self._native_decode(layer, q, kv_cache, decodes)
        out = torch.empty_like(q)
        gqa = layer.num_heads != layer.num_kv_heads
        for i, req in enumerate(metadata.prefills):
            first_key, mask = metadata.prefill_mask(i, layer.sliding_window)
            slots = req.key_slots[first_key:]
            # [1, heads, tokens, head_size]: sdpa takes its fused CPU (flash) kernel only for 4-d inputs;
            # 3-d ones fall back to the unfused math path, 4-6x slower.
            keys = kv_quant.read(key_cache, slots, q.dtype, layer.k_scale).transpose(0, 1)[None]
            values = kv_quant.read(value_cache, slots, q.dtype, layer.v_scale).transpose(0, 1)[None]
            queries = q[req.queries].transpose(0, 1)[None]
            if layer.logits_soft_cap:  # sdpa has no soft cap: the scores in float32, capped
                attn = _capped_prefill(queries, keys, values, mask, layer)
            else:
                attn = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=gqa
                )
            out[req.queries] = attn[0].transpose(0, 1)
        if native:
            out[decodes.rows] = self._native_decode(layer, q[decodes.rows], kv_cache, decodes)
        elif decodes is not None:
            out[decodes.rows] = self._decode(
                layer,
                q[decodes.rows],
                kv_quant.read(key_cache, decodes.key_slots, torch.float32, layer.k_scale),
                kv_quant.read(value_cache, decodes.key_slots, torch.float32, layer.v_scale),
                metadata.decode_mask(layer.sliding_window),
            )
        return out

    def forward_mla(
        self,
        layer: AttentionLayerSpec,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_latent: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        cache, rank, dtype = kv_cache[0], layer.mla.kv_lora_rank, q_nope.dtype
        kv_quant.write(cache, metadata.batch.slot_mapping, torch.cat([kv_latent, k_pe], -1)[:, None], layer.k_scale)
        out = q_nope.new_empty(*q_nope.shape[:2], layer.mla.v_head_dim)
        for i, req in enumerate(metadata.prefills):
            _, mask = metadata.prefill_mask(i, None)
            rows = kv_quant.read(cache, req.key_slots, dtype, layer.k_scale)[:, 0]  # [S, rank + rope]
            latent, keys_pe = rows[:, :rank], rows[:, rank:]
            keys_nope = latent @ w_uk.transpose(1, 2)  # [heads, S, nope]
            keys = torch.cat([keys_nope, keys_pe.expand(keys_nope.shape[0], -1, -1)], -1)
            queries = torch.cat([q_nope[req.queries], q_pe[req.queries]], -1).transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                queries[None], keys[None], (latent @ w_uv)[None], attn_mask=mask, scale=layer.scale
            )
            out[req.queries] = attn[0].transpose(0, 1)
        decodes = metadata.decodes
        if decodes is not None:
            out[decodes.rows] = self._mla_decode(
                layer, q_nope[decodes.rows], q_pe[decodes.rows], w_uk, w_uv, cache, decodes, metadata.batch.block_size
            )
        return out

    @staticmethod
    def _mla_decode(
        layer: AttentionLayerSpec,
        q_nope: torch.Tensor,  # [D, heads, nope]
        q_pe: torch.Tensor,  # [D, heads, rope]
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        cache: torch.Tensor,
        decodes: _Decodes,
        block_size: int,
    ) -> torch.Tensor:
        """The absorbed form: scores and the weighted sum are taken over the latent rows, in float32."""
        slots = decodes.key_slots
        if slots is None:  # prepared for the native kernel: every slot of the request's blocks
            offsets = torch.arange(block_size, device=q_nope.device)
            slots = (decodes.block_tables.long()[:, :, None] * block_size + offsets).flatten(1)
        mask = torch.arange(slots.shape[1], device=slots.device) < decodes.seq_lens[:, None]  # [D, L]
        rows = kv_quant.read(cache, slots, torch.float32, layer.k_scale)[:, :, 0]  # [D, L, rank + rope]
        # Padding slots may hold anything (NaN): zeroed, since a zero probability times NaN is still NaN.
        rows = torch.where(mask[..., None], rows, 0.0)
        latent, keys_pe = rows[..., : layer.mla.kv_lora_rank], rows[..., layer.mla.kv_lora_rank :]
        q_latent = (q_nope.transpose(0, 1) @ w_uk).transpose(0, 1).float()  # [D, heads, rank]
        scores = (q_latent @ latent.transpose(1, 2) + q_pe.float() @ keys_pe.transpose(1, 2)) * layer.scale
        scores.masked_fill_(~mask[:, None, :], float("-inf"))
        out_latent = (scores.softmax(dim=-1) @ latent).to(q_nope.dtype)  # [D, heads, rank]
        return (out_latent.transpose(0, 1) @ w_uv).transpose(0, 1)  # [D, heads, v_head_dim]

    @staticmethod
    def _native_decode(
        layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, decodes: _Decodes
    ) -> torch.Tensor:
        return torch.ops.fw_attention_torch.paged_decode(
            q, kv_cache[0], kv_cache[1], decodes.block_tables, decodes.seq_lens, layer.scale,
            layer.sliding_window or 0, layer.logits_soft_cap or 0.0, layer.k_scale, layer.v_scale,
        )

    @staticmethod
    def _decode(
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [D, heads, head_size]
        keys: torch.Tensor,  # [D, max_len, kv_heads, head_size] float32
        values: torch.Tensor,  # [D, max_len, kv_heads, head_size] float32
        mask: torch.Tensor,  # [D, max_len]
    ) -> torch.Tensor:
        """One query per request against its padded keys, in float32 for accuracy."""
        num_reqs, kv_heads = q.shape[0], layer.num_kv_heads
        # Query head h reads KV head h // group, so consecutive query heads share one KV head.
        grouped = q.view(num_reqs, kv_heads, -1, layer.head_size).float()
        scores = _capped(grouped @ keys.permute(0, 2, 3, 1) * layer.scale, layer)  # [D, kv_heads, group, max_len]
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        out = scores.softmax(dim=-1) @ values.transpose(1, 2)  # [D, kv_heads, group, head_size]
        return out.view(num_reqs, layer.num_heads, layer.head_size).to(q.dtype)
