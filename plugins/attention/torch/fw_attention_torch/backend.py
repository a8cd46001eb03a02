"""Paged attention with plain torch ops.

Per step, ``prepare`` turns each request's block table into the cache slots
of its keys, in position order. Per layer, ``forward`` scatters the new K/V
into the cache at ``slot_mapping`` and then attends: requests with several
new tokens (prefill, or a prefill chunk on top of cached context) one at a
time, all one-token requests (decode) together. Both are ``fw.sdk.kernels``
operations, whose candidates a layer's first step times per CPU and shape
class (head size and counts, dtypes, device, window and soft cap):

``attention.decode`` (rows: the step's decode requests; timed with
``DECODE_CONTEXT`` tokens of context each):
- ``fw``: a native kernel (``csrc/paged_attention.cpp``, built on first use, CPU
  only) that reads keys and values block by block where they lie in the cache.
- ``torch``, the reference: one batched float32 product over their keys
  gathered and padded to the longest (per-request calls would cost more in
  call overhead than in arithmetic). The gather alone cost more than the
  whole native kernel.

``attention.prefill`` (rows: a chunk's query tokens; timed on fresh prompts
of ``PREFILL_ROWS`` tokens):
- ``fw``: the native kernel's prefill (``csrc/paged_attention.cpp``): a few
  consecutive tokens of the chunk and one KV head per task, so that every key
  and value read from the cache serves all their query heads, each token
  attending up to its own position. Each token's result is the decode
  kernel's for a request of its length, bit for bit. On Zen 5 at 128 tokens of
  Qwen2-0.5B's heads: 0.11 ms a layer, against sdpa's 0.44-0.48.
- ``torch``, the reference: ``scaled_dot_product_attention`` in the query
  dtype over the chunk's keys gathered.
- ``torch-fp32``: the same on float32 copies of the queries, keys and values
  (CPU, 16-bit queries), for CPUs without bf16 arithmetic (sdpa's flash kernel
  widens its blocks itself: on an AVX2 EPYC the two were within noise of each
  other).
Layers with a logit soft cap take their scores in float32 in ``torch`` (sdpa
has no cap) and in ``fw``.

Query ``j`` of a request with ``seq_len`` S and ``query_len`` Q sits at
position ``S - Q + j`` and sees the keys up to its own position (with a
sliding window W, only the last W of them). That one rule covers fresh
prefill, chunked prefill against cached context, and decode.

Every KV-cache dtype of ``fw.sdk.kv_quant`` is read by every candidate: the torch
ones dequantize the keys and values they gather, the native kernel each row
as it reads it.

Multi-head latent attention (``forward_mla``) caches one row per token, the
latent and the rotary key. Prefill rows expand the cached latents to every
head's K and V and attend as above; decodes never expand them: W_UK folds into
the query and W_UV into the output, so each step reads the latent rows once
(DeepSeek-V2's "absorbed" form).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fw.interfaces.attention import GRAPH_MAX_QUERY_LEN, AttentionBackend, AttentionBatch, AttentionLayerSpec
from fw.sdk import kernels, kv_quant, native

_NATIVE_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
DECODE_CONTEXT = 256  # tokens of context per request that decode candidates are timed on
PREFILL_ROWS = (16, 64, 256, 1024)  # query tokens per chunk the prefill candidates are timed on
# A request with at most this many new tokens attends as that many decode rows (speculative decoding's k + 1):
# below the smallest prefill the prefill candidates are timed on, and at least what decode graphs capture.
DECODE_QUERY_ROWS = PREFILL_ROWS[0] - 1
assert DECODE_QUERY_ROWS >= GRAPH_MAX_QUERY_LEN


@dataclass
class _Prefill:
    queries: slice  # its rows of the flattened batch
    key_slots: torch.Tensor  # [seq_len] int64: the cache slot of each position
    first_query_pos: int
    block_table: torch.Tensor  # [max_blocks] int32: the request's blocks


@dataclass(frozen=True)
class _Chunk:
    """What a prefill candidate reads of one request's chunk: the slots of the keys any of its queries sees, in
    position order, and the [queries, keys] boolean mask of which each one sees (None: causal over a fresh prompt);
    or, for the native kernel, the request's block table and its first query's position."""

    key_slots: torch.Tensor
    mask: torch.Tensor | None
    block_table: torch.Tensor
    first_query_pos: int


@dataclass
class _Decodes:
    rows: torch.Tensor  # [D] each decode request's query row
    seq_lens: torch.Tensor  # [D] int32
    block_tables: torch.Tensor  # [D, max_blocks] int32
    block_size: int
    max_len: int  # the longest seq_len
    # What the gathering candidate reads, built on its first use in the step (a layer may choose the native one).
    _key_slots: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def key_slots(self) -> torch.Tensor:
        """[D, max_len] the cache slot of each request's keys in position order, padded."""
        if self._key_slots is None:
            pos = torch.arange(self.max_len, device=self.seq_lens.device)[None, :]
            # Padded columns repeat the request's first key: masked out, but never unwritten (NaN) cache
            # memory, which would poison the probabilities-times-values product.
            pos = torch.where(pos < self.seq_lens[:, None], pos, 0)
            blocks = self.block_tables.long().gather(1, pos // self.block_size)
            self._key_slots = blocks * self.block_size + pos % self.block_size
        return self._key_slots

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[D, max_len] boolean: which padded key columns each request sees."""
        if sliding_window not in self._masks:
            seq_lens = self.seq_lens[:, None]
            k_pos = torch.arange(self.max_len, device=seq_lens.device)[None, :]
            mask = k_pos < seq_lens
            if sliding_window is not None:
                mask &= k_pos >= seq_lens - sliding_window
            self._masks[sliding_window] = mask
        return self._masks[sliding_window]


@dataclass
class TorchAttentionMetadata:
    batch: AttentionBatch
    prefills: list[_Prefill]
    decodes: _Decodes | None
    # Masks depend on the layer only through its sliding window: built once per step and window.
    _masks: dict[tuple[int, int | None], tuple[int, torch.Tensor | None]] = field(default_factory=dict)

    def prefill_mask(self, i: int, sliding_window: int | None) -> tuple[int, torch.Tensor | None]:
        """The first key position any query of prefill ``i`` sees, and the [Q, keys] boolean mask: None for a
        fresh prompt without a window, which sdpa's causal flag covers (it skips the masked blocks: ~30% of the
        product at 1024 tokens)."""
        key = (i, sliding_window)
        if key not in self._masks:
            req = self.prefills[i]
            if sliding_window is None and req.first_query_pos == 0:
                self._masks[key] = (0, None)
                return self._masks[key]
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

    def chunk(self, i: int, sliding_window: int | None) -> _Chunk:
        """Prefill ``i`` as its candidates read it, for a layer with ``sliding_window``."""
        req = self.prefills[i]
        first_key, mask = self.prefill_mask(i, sliding_window)
        return _Chunk(req.key_slots[first_key:], mask, req.block_table, req.first_query_pos)


def _decode_rows(batch: AttentionBatch) -> _Decodes:
    """Every query row of the batch as a decode: query j of a request with ``seq_len`` S and Q new tokens (a decode,
    or drafts verified at once) attends as a decode of length S - Q + j + 1, so the decode kernel reads the context
    where it lies, where a prefill would gather it first. Computed from the batch's tensors alone: a decode graph
    (``fw.decode_graph``) replays it on any batch of the same request and token counts."""
    ends = batch.query_start_loc[1:]
    rows = torch.arange(batch.slot_mapping.shape[0], dtype=ends.dtype, device=ends.device)
    owner = torch.searchsorted(ends, rows, right=True)  # each row's request
    seq_lens = batch.seq_lens[owner] - ends[owner] + rows + 1
    return _Decodes(rows.long(), seq_lens, batch.block_tables[owner], batch.block_size, batch.max_seq_len)


def _capped(scores: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """Scores under the layer's logit soft cap, if it has one (Gemma 2): cap * tanh(scores / cap)."""
    cap = layer.logits_soft_cap
    return scores if not cap else cap * torch.tanh(scores / cap)


def _capped_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    layer: AttentionLayerSpec) -> torch.Tensor:
    """sdpa's product for [1, heads, Q, D] queries over [1, kv_heads, S, D] keys and values, with the soft cap."""
    if mask is None:  # causal
        mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool, device=q.device).tril()
    group = layer.num_heads // layer.num_kv_heads
    keys, values = (t.float().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = _capped(q.float() @ keys.transpose(-1, -2) * layer.scale, layer)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)


# The candidates. Each takes the layer's spec (its "weight") and the queries as [rows, heads * head_size], so that
# a selection's rows are the decode requests or the chunk's tokens, and returns [rows, heads, head_size].

def _prefill(layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, chunk: _Chunk,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """One request's chunk against its keys gathered, with sdpa in ``dtype`` (the query's by default)."""
    dtype, mask = dtype or q.dtype, chunk.mask
    # [1, heads, tokens, head_size]: sdpa takes its fused CPU (flash) kernel only for 4-d inputs;
    # 3-d ones fall back to the unfused math path, 4-6x slower.
    keys = kv_quant.read(kv_cache[0], chunk.key_slots, dtype, layer.k_scale).transpose(0, 1)[None]
    values = kv_quant.read(kv_cache[1], chunk.key_slots, dtype, layer.v_scale).transpose(0, 1)[None]
    queries = q.view(len(q), layer.num_heads, layer.head_size).transpose(0, 1)[None].to(dtype)
    if layer.logits_soft_cap:  # sdpa has no soft cap: the scores in float32, capped
        attn = _capped_prefill(queries, keys, values, mask, layer)
    else:
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads)
    return attn[0].transpose(0, 1).to(q.dtype)


def _native_prefill(layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    return torch.ops.fw_attention_torch.paged_prefill(
        q.view(len(q), layer.num_heads, layer.head_size), kv_cache, chunk.block_table, chunk.first_query_pos,
        layer.scale, layer.sliding_window or 0, layer.logits_soft_cap or 0.0, layer.k_scale, layer.v_scale,
    )


def _native_decode(layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor,
                   decodes: _Decodes) -> torch.Tensor:
    return torch.ops.fw_attention_torch.paged_decode(
        q.view(len(q), layer.num_heads, layer.head_size), kv_cache, decodes.block_tables, decodes.seq_lens,
        layer.scale, layer.sliding_window or 0, layer.logits_soft_cap or 0.0, layer.k_scale, layer.v_scale,
    )


def _gathered_decode(layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor,
                     decodes: _Decodes) -> torch.Tensor:
    """One query per request against its keys gathered and padded, in float32 for accuracy."""
    slots, num_reqs, kv_heads = decodes.key_slots(), len(q), layer.num_kv_heads
    keys = kv_quant.read(kv_cache[0], slots, torch.float32, layer.k_scale)  # [D, max_len, kv_heads, head_size]
    values = kv_quant.read(kv_cache[1], slots, torch.float32, layer.v_scale)
    # Query head h reads KV head h // group, so consecutive query heads share one KV head.
    grouped = q.view(num_reqs, kv_heads, -1, layer.head_size).float()
    scores = _capped(grouped @ keys.permute(0, 2, 3, 1) * layer.scale, layer)  # [D, kv_heads, group, max_len]
    scores.masked_fill_(~decodes.mask(layer.sliding_window)[:, None, None, :], float("-inf"))
    out = scores.softmax(dim=-1) @ values.transpose(1, 2)  # [D, kv_heads, group, head_size]
    return out.view(num_reqs, layer.num_heads, layer.head_size).to(q.dtype)


def _key(layer: AttentionLayerSpec, dtype: torch.dtype, kv_cache: torch.Tensor) -> tuple:
    """A layer's shape class: (head_size, heads, kv_heads, query dtype, cache dtype, device, sliding window,
    soft cap). Not the block size: engines that differ only in it (prefix caching's tests) choose alike, so
    their tokens agree."""
    return (layer.head_size, layer.num_heads, layer.num_kv_heads, str(dtype).removeprefix("torch."),
            str(kv_cache.dtype).removeprefix("torch."), kv_cache.device.type, layer.sliding_window is not None,
            bool(layer.logits_soft_cap))


def _has_native(device_type: str) -> bool:
    return device_type == "cpu" and native.load("fw_attention_torch", _NATIVE_SOURCE)


def _widens(key: tuple) -> bool:
    """sdpa in float32 is worth timing on the CPU, for 16-bit queries and layers without a soft cap."""
    _, _, _, dtype, _, device, _, soft_cap = key
    return dtype in ("bfloat16", "float16") and device == "cpu" and not soft_cap


DECODE = kernels.Operation("attention.decode", reference="torch")
DECODE.register(kernels.Candidate("fw", _native_decode, supports=lambda key: _has_native(key[5])))
DECODE.register(kernels.Candidate("torch", _gathered_decode))
PREFILL = kernels.Operation("attention.prefill", reference="torch", rows=PREFILL_ROWS)
PREFILL.register(kernels.Candidate("fw", _native_prefill, supports=lambda key: _has_native(key[5])))
PREFILL.register(kernels.Candidate("torch", _prefill))
PREFILL.register(kernels.Candidate("torch-fp32", functools.partial(_prefill, dtype=torch.float32), supports=_widens))


@dataclass(frozen=True)
class _Kernels:
    """A layer's chosen kernels, and the cache they were chosen for (tests give one spec several caches)."""

    layer: AttentionLayerSpec
    kv_cache: torch.Tensor
    decode: kernels.Selection
    prefill: kernels.Selection


class TorchAttention(AttentionBackend):
    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._chosen: list[_Kernels | None] = []  # by layer_idx: found per step without building a key

    def native_decode(self, device: torch.device) -> bool:
        """Whether the native decode kernel (candidate ``fw`` of ``attention.decode``) runs on ``device``."""
        return _has_native(device.type)

    def supports_decode_graphs(self) -> bool:
        # The native kernel reads the lengths from the tensors; the gathering one sizes its work by max_len. An
        # int8 cache stores each row's scale through a dtype view, which torch.jit.trace cannot record.
        return bool(self._chosen) and all(
            k is not None and set(k.decode.names) == {"fw"} and k.kv_cache.dtype != torch.int8 for k in self._chosen
        )

    def prepare(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        # Without the native kernel (CUDA) a decode row gathers its whole context: a prefill reads it once.
        return self._prepare(batch, DECODE_QUERY_ROWS if _has_native(batch.block_tables.device.type) else 1)

    @staticmethod
    def _prepare(batch: AttentionBatch, decode_query_rows: int) -> TorchAttentionMetadata:
        """Requests of at most ``decode_query_rows`` new tokens attend as decode rows, longer ones as prefills."""
        block_size = batch.block_size
        device = batch.block_tables.device
        offsets = torch.arange(block_size, device=device)
        starts, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu

        def slots(i: int, length: int) -> torch.Tensor:
            blocks = batch.block_tables[i, : -(-length // block_size)].long()
            return (blocks[:, None] * block_size + offsets).flatten()[:length]

        prefills, short = [], []
        for i in range(batch.num_reqs):
            query_len = starts[i + 1] - starts[i]
            if query_len <= decode_query_rows:
                short.append(i)
            else:
                prefills.append(_Prefill(slice(starts[i], starts[i + 1]), slots(i, seq_lens[i]),
                                         seq_lens[i] - query_len, batch.block_tables[i]))
        decodes = None
        if short:
            decodes = _decode_rows(batch)
            if prefills:  # the short requests' rows alone
                index = torch.tensor([r for i in short for r in range(starts[i], starts[i + 1])], device=device)
                decodes = _Decodes(index, decodes.seq_lens[index], decodes.block_tables[index], block_size,
                                   max(seq_lens[i] for i in short))
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
        kv_quant.store_kv(kv_cache, metadata.batch.slot_mapping, k, v, layer)
        chosen = self._kernels(layer, q.dtype, kv_cache)
        decodes = metadata.decodes
        if decodes is not None and not metadata.prefills:  # a decode-only step: every row is a decode, in order
            return chosen.decode(q.flatten(1), kv_cache, decodes)
        out = torch.empty_like(q)
        for i, req in enumerate(metadata.prefills):
            out[req.queries] = chosen.prefill(q[req.queries].flatten(1), kv_cache, metadata.chunk(i, layer.sliding_window))
        if decodes is not None:
            out[decodes.rows] = chosen.decode(q[decodes.rows].flatten(1), kv_cache, decodes)
        return out

    def _kernels(self, layer: AttentionLayerSpec, dtype: torch.dtype, kv_cache: torch.Tensor) -> _Kernels:
        """The layer's decode and prefill kernels, chosen on its first step: timed once per shape class and CPU,
        on random samples, and then cached (``fw.sdk.kernels``)."""
        idx = layer.layer_idx
        chosen = self._chosen[idx] if idx < len(self._chosen) else None
        if chosen is None or chosen.layer is not layer or chosen.kv_cache is not kv_cache:
            key = _key(layer, dtype, kv_cache)

            def decode_sample(rows: int) -> tuple:
                q, cache, metadata = self._sample(layer, dtype, kv_cache, [DECODE_CONTEXT - 1] * rows, [1] * rows)
                return q, cache, metadata.decodes

            def prefill_sample(rows: int) -> tuple:
                q, cache, metadata = self._sample(layer, dtype, kv_cache, [0], [rows])
                return q, cache, metadata.chunk(0, layer.sliding_window)

            chosen = _Kernels(layer, kv_cache, DECODE.select(key, layer, decode_sample),
                              PREFILL.select(key, layer, prefill_sample))
            self._chosen.extend([None] * (idx + 1 - len(self._chosen)))
            self._chosen[idx] = chosen
        return chosen

    def _sample(self, layer: AttentionLayerSpec, dtype: torch.dtype, like: torch.Tensor, computed: list[int],
                new: list[int], prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor, TorchAttentionMetadata]:
        """A step of requests that hold ``computed`` tokens and add ``new``, over random keys and values in a
        cache laid out like ``like``: the queries [tokens, heads * head_size], the cache and the metadata (with
        ``prefill``, every request of several new tokens a prefill, however few)."""
        block, device = like.shape[2], like.device
        gen = torch.Generator().manual_seed(0)  # not the global one: the first step's sampling may draw from it
        counts = [-(-(c + n) // block) for c, n in zip(computed, new, strict=True)]
        order = torch.randperm(sum(counts), generator=gen).tolist()  # blocks scattered, as after many requests
        tables = [order[end - n : end] for n, end in zip(counts, itertools.accumulate(counts), strict=True)]
        cache = like.new_empty(2, len(order), *like.shape[2:])
        every_slot = torch.arange(len(order) * block, device=device)
        for part, scale in zip(cache, (layer.k_scale, layer.v_scale), strict=True):
            entries = torch.randn(len(every_slot), layer.num_kv_heads, layer.head_size, generator=gen)
            kv_quant.write(part, every_slot, entries.to(device, dtype), scale)
        batch = AttentionBatch.build(tables, computed, new, block, device)
        q = torch.randn(sum(new), layer.num_heads * layer.head_size, generator=gen).to(device, dtype)
        return q, cache, self._prepare(batch, 1) if prefill else self.prepare(batch)

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
                queries[None], keys[None], (latent @ w_uv)[None], attn_mask=mask, is_causal=mask is None,
                scale=layer.scale,
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
        offsets = torch.arange(block_size, device=q_nope.device)  # every slot of the request's blocks
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
