"""Triton attention backend: the paged cache in the core's standard layout, read by one kernel per layer and step.

``prepare`` cuts each request's query rows into tiles once per step (their size depends on the layer's GQA
group, so per group size, on first use); ``forward`` writes the new K/V into the cache (``fw.sdk.kv_quant``) and
launches ``kernel.unified_attention`` over (tiles, KV heads).

Multi-head latent attention runs in the absorbed form for prefill and decode alike: W_UK folds into the query
(``q_nope @ W_UK``), the kernel attends with one KV head over the cached ``latent || k_pe`` rows with the latent
as values, and W_UV maps the result to each head's values. Prefill then costs ``kv_lora_rank``-wide products
per head instead of expanding the latents (the torch backend's choice), but reads the cache once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from fw.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayerSpec
from fw.sdk import kv_quant
from fw_attention_triton.kernel import KV_AUTO, KV_FP8, KV_FP8_BITS, KV_INT8, unified_attention

# Rows of a tile: tl.dot needs at least 16; a group of more query heads per KV head takes a tile of its own.
MIN_TILE_ROWS = 16


def tile_shape(group: int) -> tuple[int, int]:
    """(query tokens, rows) of a tile for ``group`` query heads per KV head."""
    rows = max(MIN_TILE_ROWS, triton.next_power_of_2(group))
    return rows // group, rows


@dataclass
class TritonAttentionMetadata:
    batch: AttentionBatch
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles(self, tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each tile's request and first query token (within the request), for tiles of ``tokens_per_tile``."""
        if tokens_per_tile not in self._tiles:
            starts = self.batch.query_start_loc_cpu
            reqs, firsts = [], []
            for i in range(self.batch.num_reqs):
                for first in range(0, starts[i + 1] - starts[i], tokens_per_tile):
                    reqs.append(i)
                    firsts.append(first)
            device = self.batch.block_tables.device
            self._tiles[tokens_per_tile] = (
                torch.tensor(reqs, dtype=torch.int32, device=device),
                torch.tensor(firsts, dtype=torch.int32, device=device),
            )
        return self._tiles[tokens_per_tile]


def fp8_native(device: torch.device) -> bool:
    """Whether Triton loads float8_e4m3fn itself here: its interpreter and GPUs of compute capability 8.9 and up."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _quant(part: torch.Tensor) -> int:
    if part.dtype == torch.float8_e4m3fn:
        return KV_FP8 if fp8_native(part.device) else KV_FP8_BITS
    return {torch.int8: KV_INT8}.get(part.dtype, KV_AUTO)


def attend(
    q: torch.Tensor,  # [T, heads, DK]
    keys: torch.Tensor,  # [blocks, block_size, kv_heads, row]: DK columns read (plus an int8 row's scale)
    values: torch.Tensor,  # the same for values: DV columns read
    dv: int,
    metadata: TritonAttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    soft_cap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Paged attention of every query row over its request's cached keys and values; returns [T, heads, DV]."""
    batch = metadata.batch
    tokens, heads, dk = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    out = q.new_empty(tokens, heads, dv)
    tokens_per_tile, rows = tile_shape(group)
    tile_req, tile_first = metadata.tiles(tokens_per_tile)
    if tile_req.numel() == 0:
        return out
    quant = _quant(keys)
    # An int8 row ends in its float32 scale (kv_quant): read through a float32 view of the same memory.
    k_scales = keys.view(torch.float32) if quant == KV_INT8 else keys
    v_scales = values.view(torch.float32) if quant == KV_INT8 else values
    if quant == KV_FP8_BITS:
        keys, values = keys.view(torch.uint8), values.view(torch.uint8)
    row_values = keys.shape[-1] - (kv_quant.SCALE_BYTES if quant == KV_INT8 else 0)
    pad = lambda d: max(16, triton.next_power_of_2(d))  # noqa: E731 - tl.arange takes powers of two; tl.dot >= 16
    unified_attention[(tile_req.numel(), kv_heads)](
        q, keys, values, k_scales, v_scales, out,
        batch.block_tables, batch.seq_lens, batch.query_start_loc, tile_req, tile_first,
        scale, k_scale, v_scale, soft_cap or 0.0, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2), batch.block_tables.stride(0),
        GROUP=group, BLOCK_Q=tokens_per_tile, BLOCK_M=rows, BLOCK_N=batch.block_size,
        DK=dk, DV=dv, DK_PAD=pad(dk), DV_PAD=pad(dv),
        KV_QUANT=quant, SCALE_COL=row_values // kv_quant.SCALE_BYTES,
        SOFT_CAP=bool(soft_cap), WINDOW=window is not None,
    )
    return out


class TritonAttention(AttentionBackend):
    def prepare(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(batch)

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        keys, values = kv_quant.write_kv(kv_cache, metadata.batch.slot_mapping, k, v, layer)
        return attend(q, keys, values, layer.head_size, metadata, layer.scale, layer.k_scale, layer.v_scale,
                      layer.logits_soft_cap, layer.sliding_window)

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
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        cache = kv_cache[0]
        kv_quant.write(cache, metadata.batch.slot_mapping, torch.cat([kv_latent, k_pe], -1)[:, None], layer.k_scale)
        q_latent = (q_nope.transpose(0, 1) @ w_uk).transpose(0, 1)  # [T, heads, kv_lora_rank]
        # The latent row is scaled by k_scale alone (MLADims): its value columns too.
        out_latent = attend(torch.cat([q_latent, q_pe], -1), cache, cache, layer.mla.kv_lora_rank, metadata,
                            layer.scale, layer.k_scale, layer.k_scale)
        return (out_latent.transpose(0, 1) @ w_uv).transpose(0, 1)  # [T, heads, v_head_dim]
