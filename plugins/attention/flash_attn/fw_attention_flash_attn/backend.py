"""FlashAttention attention backend.

The core's standard cache layout, ``(2, num_blocks, block_size, kv_heads, head_size)``, is flash-attn's paged
layout once split: ``cache[0]`` and ``cache[1]`` are the ``k_cache`` / ``v_cache`` of shape
``[num_blocks, page_block_size, kv_heads, head_size]`` that both versions take with a block table, so
``kv_cache_spec`` is not overridden and other plugins (KV connectors) keep seeing the usual layout.

- FlashAttention-2 (package ``flash_attn``): ``flash_attn_varlen_func`` with ``block_table``; each request's key
  count comes from ``cu_seqlens_k`` (the upstream Python function has no ``seqused_k``). Its paged path needs a
  block size divisible by 256.
- FlashAttention-3 (module ``flash_attn_interface``, built from the repository's ``hopper/``), on compute
  capability 9.x when it imports: its ``flash_attn_varlen_func`` takes no page table, so
  ``flash_attn_with_kvcache`` with ``page_table``, ``cache_seqlens`` and ``cu_seqlens_q``.

Both align the causal mask to the end of each request's keys, which is ``AttentionBatch``'s rule that the new
tokens are the last ones, so one call serves prefill chunks and decodes alike.

flash-attn is imported when the backend is constructed, never at module level: listing and validating plugins
import this module's spec only, and tests import this module without flash-attn.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from fw.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayerSpec
from fw.sdk import kv_quant

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the flash_attn attention backend needs a CUDA GPU (compute capability >= 8.0) and the flash-attn "
    "package (>= 2.6); install with pip install '.[flash-attn]'"
)
MIN_COMPUTE_CAPABILITY = (8, 0)
FA2_MODULE = "flash_attn"
FA3_MODULE = "flash_attn_interface"
FA2_BLOCK_MULTIPLE = 256


def _load_fa3() -> Any | None:
    """FlashAttention-3's module if it imports and pages the KV cache, else None (FA2 then runs)."""
    if importlib.util.find_spec(FA3_MODULE) is None:
        return None
    try:
        module = importlib.import_module(FA3_MODULE)
        paged = "page_table" in inspect.signature(module.flash_attn_with_kvcache).parameters
    except Exception as exc:  # a broken FA3 build must not hide a working FA2
        logger.warning("%s is unusable (%s: %s); using FlashAttention-2", FA3_MODULE, type(exc).__name__, exc)
        return None
    if not paged:  # builds from before 2025 had no paged KV
        logger.warning("%s takes no page_table (too old); using FlashAttention-2", FA3_MODULE)
        return None
    return module


def load_flash_attn() -> tuple[int, Any]:
    """(FlashAttention version, its module), or a RuntimeError that names every missing piece."""
    missing = []
    capability = None
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible to torch")
    else:
        capability = torch.cuda.get_device_capability()
        if capability < MIN_COMPUTE_CAPABILITY:
            missing.append(f"the GPU has compute capability {capability[0]}.{capability[1]}")
    if importlib.util.find_spec(FA2_MODULE) is None:
        missing.append("the flash-attn package is not installed")
    if missing:
        raise RuntimeError(f"{INSTALL_HINT} ({'; '.join(missing)})")
    if capability[0] == 9:  # FA3's kernels are Hopper's (vLLM picks it on 9.x only too)
        fa3 = _load_fa3()
        if fa3 is not None:
            return 3, fa3
    try:
        return 2, importlib.import_module(FA2_MODULE)
    except Exception as exc:  # a broken install (CUDA/ABI mismatch) is as fatal as a missing one
        raise RuntimeError(f"{INSTALL_HINT} (importing flash_attn failed: {type(exc).__name__}: {exc})") from exc


@dataclass
class FlashAttnMetadata:
    """One step's batch as flash-attn takes it: only the requests with new tokens this step."""

    slot_mapping: torch.Tensor  # [T] int64: where forward() writes the new K/V
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: request i's query rows
    kv_lens: torch.Tensor  # int32: FA2 cumulative key counts [B + 1]; FA3 key counts [B]
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_reqs(self) -> int:
        return self.block_table.shape[0]


class FlashAttnAttention(AttentionBackend):
    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # Fail at construction, with the reason, rather than with an ImportError mid-forward.
        self.version, self._fa = load_flash_attn()

    def prepare(self, batch: AttentionBatch) -> FlashAttnMetadata:
        bs = batch.block_size
        if self.version == 2 and bs % FA2_BLOCK_MULTIPLE:
            raise ValueError(
                f"FlashAttention-2 pages the KV cache in blocks divisible by {FA2_BLOCK_MULTIPLE}, got block size "
                f"{bs}; run with --block-size 256"
            )
        device = batch.block_tables.device
        qsl = batch.query_start_loc_cpu
        # Requests with no new tokens (a step may carry them) are left out, which leaves every row offset as it
        # is; FA2's one-token decode path also assumes one query row per request.
        active = [i for i in range(batch.num_reqs) if qsl[i + 1] > qsl[i]]
        seq_lens = [batch.seq_lens_cpu[i] for i in active]
        kv_lens = [0, *accumulate(seq_lens)] if self.version == 2 else seq_lens
        block_table = batch.block_tables
        if len(active) < batch.num_reqs:
            block_table = block_table[torch.tensor(active, dtype=torch.int64, device=device)]

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return FlashAttnMetadata(
            slot_mapping=batch.slot_mapping,
            cu_seqlens_q=int32([0] + [qsl[i + 1] for i in active]),
            kv_lens=int32(kv_lens),
            block_table=block_table.to(torch.int32).contiguous(),
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=max(seq_lens, default=0),
        )

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_quant.write_kv(kv_cache, metadata.slot_mapping, k, v, layer)
        if metadata.num_reqs == 0:  # no request has new tokens; the kernels refuse an empty batch
            return torch.empty_like(q)
        common = {
            "softmax_scale": layer.scale,
            "causal": True,
            # flash-attn's left window counts the keys before the query; the layer's window includes the query.
            "window_size": (layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1),
            "softcap": layer.logits_soft_cap or 0.0,  # 0 turns it off
        }
        if self.version == 3:
            return self._fa.flash_attn_with_kvcache(
                q, k_cache, v_cache,
                cache_seqlens=metadata.kv_lens,
                page_table=metadata.block_table,
                cu_seqlens_q=metadata.cu_seqlens_q,
                max_seqlen_q=metadata.max_seqlen_q,
                **common,
            )
        return self._fa.flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k=metadata.kv_lens,
            max_seqlen_q=metadata.max_seqlen_q,
            max_seqlen_k=metadata.max_seqlen_k,
            block_table=metadata.block_table,
            **common,
        )
