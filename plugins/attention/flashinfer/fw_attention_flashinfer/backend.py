"""FlashInfer attention backend.

The core's standard cache layout, ``(2, num_blocks, block_size, kv_heads,
head_size)``, is FlashInfer's "NHD" paged layout once split into a
``(k_cache, v_cache)`` tuple, so ``kv_cache_spec`` is not overridden and
other plugins (KV connectors) keep seeing the usual layout. An fp8 cache is
that layout in float8_e4m3fn, which FlashInfer reads given the layer's scales.

One ``BatchPrefillWithPagedKVCacheWrapper`` serves prefill chunks and decodes
alike: its causal mask is aligned to the end of each request's KV, which is
exactly ``AttentionBatch``'s rule that the new tokens are the last ones.

The ``flashinfer_mla`` plugin is this class under a record of its own (MLA models only, DeepSeek's 512/64
latent): ``forward_mla`` runs ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on the core's latent cache.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from fw.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayerSpec
from fw.sdk import kv_quant

INSTALL_HINT = (
    "the flashinfer attention backend needs a CUDA GPU (compute capability >= 8.0) and the "
    "flashinfer-python package; install with pip install '.[flashinfer]'"
)
MIN_COMPUTE_CAPABILITY = (8, 0)
# Scratch space for split-KV partial results, shared by all wrappers (they run one after another
# on one stream). FlashInfer's docs use 128 MiB; large mixed batches can need more.
WORKSPACE_BYTES = 256 * 1024 * 1024


def load_flashinfer() -> Any:
    """Import flashinfer, or raise a RuntimeError that names every missing piece."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible to torch")
    else:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < MIN_COMPUTE_CAPABILITY:
            missing.append(f"the GPU has compute capability {major}.{minor}")
    if importlib.util.find_spec("flashinfer") is None:
        missing.append("the flashinfer-python package is not installed")
    if missing:
        raise RuntimeError(f"{INSTALL_HINT} ({'; '.join(missing)})")
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # a broken install (CUDA/ABI mismatch) is as fatal as a missing one
        raise RuntimeError(f"{INSTALL_HINT} (importing flashinfer failed: {type(exc).__name__}: {exc})") from exc


@dataclass
class FlashInferMetadata:
    """One step's batch in FlashInfer's CSR page-table form."""

    slot_mapping: torch.Tensor  # [T] int64, device: where forward() writes the new K/V
    qo_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indptr: torch.Tensor  # [B + 1] int32, host: request i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [total pages] int32, device
    kv_last_page_len: torch.Tensor  # [B] int32, host: 1..block_size
    kv_lens: torch.Tensor  # [B] int32, host: each request's keys (MLA's plan takes them whole)
    block_size: int


class FlashInferAttention(AttentionBackend):
    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # Fail at construction, with the reason, rather than with an ImportError mid-forward.
        self._flashinfer = load_flashinfer()
        self._workspace: torch.Tensor | None = None
        # plan() state lives in a wrapper, so each distinct layer configuration gets its own wrapper,
        # stored with the metadata it was last planned for.
        self._wrappers: dict[tuple, tuple[Any, FlashInferMetadata]] = {}

    def prepare(self, batch: AttentionBatch) -> FlashInferMetadata:
        device = batch.block_tables.device
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        bs = batch.block_size
        qsl = batch.query_start_loc_cpu
        # Requests with no new tokens (a step may carry them) produce no rows; FlashInfer is given
        # only the others, which leaves every row offset unchanged.
        active = [i for i in range(batch.num_reqs) if qsl[i + 1] > qsl[i]]
        # Everything but the page ids is built from the host copies: plan() needs them on the host anyway.
        seq_lens = torch.tensor([batch.seq_lens_cpu[i] for i in active], dtype=torch.int32)
        num_pages = (seq_lens + bs - 1) // bs
        kv_indptr = torch.zeros(len(active) + 1, dtype=torch.int32)
        torch.cumsum(num_pages, 0, out=kv_indptr[1:])
        # Each used page's position in the flattened block table, so the page ids are gathered on the
        # device without reading the block table back (a sync).
        width = batch.block_tables.shape[1]
        rows = torch.repeat_interleave(torch.tensor(active, dtype=torch.int64), num_pages)
        cols = torch.arange(int(kv_indptr[-1])) - kv_indptr[:-1].repeat_interleave(num_pages)
        flat = (rows * width + cols).to(device, non_blocking=True)
        return FlashInferMetadata(
            slot_mapping=batch.slot_mapping,
            qo_indptr=torch.tensor([0] + [qsl[i + 1] for i in active], dtype=torch.int32),
            kv_indptr=kv_indptr,
            kv_indices=batch.block_tables.reshape(-1)[flat].to(torch.int32),
            kv_last_page_len=seq_lens - (num_pages - 1) * bs,
            kv_lens=seq_lens,
            block_size=bs,
        )

    def _planned(self, key: tuple, make: Any, plan: Any, meta: FlashInferMetadata) -> Any:
        """The wrapper for one layer configuration (``key``), planned for this step's ``meta``: the first layer
        of the configuration in a step plans, the others reuse the plan."""
        wrapper, planned_for = self._wrappers.get(key, (None, None))
        if wrapper is None:
            wrapper = make(self._workspace)
        if planned_for is not meta:
            plan(wrapper)
            self._wrappers[key] = (wrapper, meta)
        return wrapper

    def _planned_wrapper(
        self, layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, meta: FlashInferMetadata
    ) -> Any:
        # FlashInfer's window_left counts the keys left of the query; the layer's window includes the query.
        window_left = layer.sliding_window - 1 if layer.sliding_window else -1
        key = (
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_size,
            layer.scale,
            window_left,
            layer.logits_soft_cap,
            q.dtype,
            kv_cache.dtype,
        )
        return self._planned(
            key,
            lambda workspace: self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"),
            lambda wrapper: wrapper.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_size,
                meta.block_size,
                causal=True,
                sm_scale=layer.scale,
                window_left=window_left,
                logits_soft_cap=layer.logits_soft_cap,
                q_data_type=q.dtype,
                kv_data_type=kv_cache.dtype,
            ),
            meta,
        )

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_quant.write_kv(kv_cache, metadata.slot_mapping, k, v, layer)
        wrapper = self._planned_wrapper(layer, q, kv_cache, metadata)
        if kv_cache.dtype == torch.float8_e4m3fn:  # the layer's scales apply to an fp8 cache only
            return wrapper.run(q, (k_cache, v_cache), k_scale=layer.k_scale, v_scale=layer.v_scale)
        return wrapper.run(q, (k_cache, v_cache))

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
        metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        """FlashInfer's MLA kernel, absorbed for prefill chunks and decodes alike (the ``flashinfer_mla`` plugin):
        it reads the latent and the rotary key as two views of the cache's one row per token."""
        mla = layer.mla
        rows = kv_cache[0, :, :, 0]  # [blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        kv_quant.write(kv_cache[0], metadata.slot_mapping, torch.cat([kv_latent, k_pe], -1)[:, None], layer.k_scale)
        wrapper = self._planned(
            ("mla", layer.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, layer.scale, q_nope.dtype, rows.dtype),
            lambda workspace: self._flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace),
            lambda wrapper: wrapper.plan(
                metadata.qo_indptr,
                metadata.kv_indptr,
                metadata.kv_indices,
                metadata.kv_lens,
                layer.num_heads,
                mla.kv_lora_rank,
                mla.qk_rope_head_dim,
                metadata.block_size,
                True,  # causal, aligned to the end of each request's keys
                layer.scale,
                q_nope.dtype,
                rows.dtype,
            ),
            metadata,
        )
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, kv_lora_rank]
        out = wrapper.run(
            q_latent.contiguous(), q_pe.contiguous(), rows[..., : mla.kv_lora_rank], rows[..., mla.kv_lora_rank :]
        )
        return torch.bmm(out.transpose(0, 1), w_uv).transpose(0, 1)  # [T, heads, v_head_dim]
