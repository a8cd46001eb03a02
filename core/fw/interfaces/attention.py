"""Attention backend interface (plugin kind ``fw.attention``).

The core owns the paged KV cache's bookkeeping in blocks; a backend owns the
kernel and the layout of a block (``kv_cache_spec``), from which the model
runner sizes and allocates the cache. Once per engine step the model runner
describes the batch as an ``AttentionBatch``; the backend may turn it into its
own metadata in ``prepare`` (FlashInfer's plan(), say), and every attention
layer then calls ``forward`` with that metadata (``forward_mla`` for the
latent attention of DeepSeek-V2/V3). Tokens of all requests are flattened
into one dimension, prefill chunks and decodes mixed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from fw.interfaces.base import Capabilities, Requirements

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

API_VERSION = 1

# Feature flags that models and other slots may require of a backend. "fp8_kv" is not declared as a feature:
# a backend has it when its kv_cache_dtypes include fp8.
FEATURES = frozenset({"sliding_window", "mla", "fp8_kv", "cuda_graph", "soft_cap"})
DERIVED_FEATURES = frozenset({"fp8_kv"})

# The values of --kv-cache-dtype: auto is the model dtype; fp8 is float8_e4m3fn with a per-layer scale for K and
# one for V; int8 has a scale per token and head (fw.sdk.kv_quant stores and reads them).
KVCacheDtype = Literal["auto", "fp8", "int8"]
KV_CACHE_DTYPES = frozenset(get_args(KVCacheDtype))
# The most new tokens of a request in a step that decode graphs capture (supports_decode_graphs): a decode and up
# to 7 speculative drafts.
GRAPH_MAX_QUERY_LEN = 8


@dataclass(frozen=True)
class AttentionCapabilities(Capabilities):
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})  # those the backend's kernels read
    head_sizes: frozenset[int] | None = None  # None: any head size
    block_sizes: frozenset[int] | None = None  # None: any block size
    # A backend with kernels for multi-head latent attention only (it declares "mla"), refusing other models.
    mla_only: bool = False
    # The (kv_lora_rank, qk_rope_head_dim) its MLA kernels take; None: any.
    mla_dims: frozenset[tuple[int, int]] | None = None

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {
        **Capabilities.KNOWN,
        "features": FEATURES - DERIVED_FEATURES,
        "kv_cache_dtypes": KV_CACHE_DTYPES,
    }

    @property
    def provided_features(self) -> frozenset[str]:
        """The declared features and those that follow from the other fields."""
        return self.features | ({"fp8_kv"} if "fp8" in self.kv_cache_dtypes else frozenset())

    def problems(self, req: Requirements) -> list[str]:
        out = super().problems(req)
        if self.head_sizes is not None and req.head_size is not None and req.head_size not in self.head_sizes:
            out.append(f"does not support head size {req.head_size} (supports {sorted(self.head_sizes)})")
        if req.kv_cache_dtype not in self.kv_cache_dtypes:
            out.append(
                f"does not support KV-cache dtype {req.kv_cache_dtype} "
                f"(supports {', '.join(sorted(self.kv_cache_dtypes))})"
            )
        if self.block_sizes is not None and req.block_size is not None and req.block_size not in self.block_sizes:
            out.append(f"does not support block size {req.block_size} (supports {sorted(self.block_sizes)})")
        for feature in sorted(req.attention_features - self.provided_features):
            out.append(f"does not support {feature}")
        if self.mla_only and req.architecture is not None and "mla" not in req.attention_features:
            out.append("runs multi-head latent attention only (DeepSeek-V2/V3); the model has standard attention")
        if self.mla_dims is not None and req.mla_dims is not None and req.mla_dims not in self.mla_dims:
            shown = ", ".join(f"{r}/{p}" for r, p in sorted(self.mla_dims))
            out.append(f"does not support an MLA latent/rope width of {req.mla_dims[0]}/{req.mla_dims[1]} "
                       f"(supports {shown})")
        return out


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V are expanded from a cached low-rank latent.

    The layer's spec then has ``head_size`` = qk_nope + qk_rope (the query/key head) and ``num_kv_heads`` 1 (the
    latent); an fp8 cache scales the latent row by ``k_scale``.
    """

    kv_lora_rank: int  # the latent's width
    qk_rope_head_dim: int  # the rotary part of each query/key head, cached beside the latent
    qk_nope_head_dim: int  # the part of each query/key head without rotary embedding
    v_head_dim: int


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static description of one attention layer, fixed at model construction."""

    num_heads: int  # query heads on this tensor-parallel rank
    num_kv_heads: int  # KV heads on this rank
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent keys
    layer_idx: int = 0
    logits_soft_cap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    mla: MLADims | None = None
    # An fp8 cache stores K / k_scale and V / v_scale: a checkpoint's calibrated scales, else 1.0 (as vLLM).
    # fw.model_loader.KVCacheScales replaces the layer's spec with them after loading, before any step.
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV cache as its backend lays it out; the model runner sizes and allocates the cache from it.

    The layer's cache is one tensor of ``shape(num_blocks)`` in ``dtype``: the parts (K, V) first, then the
    blocks, so block ``b`` is ``cache[:, b]`` in every format and copy-on-write and KV connectors move blocks
    without knowing the format. Scales that vary per token live inside the entry (int8: each head's row ends in
    its float32 scale); per-layer scales are the layer's ``k_scale`` and ``v_scale``.
    """

    block_size: int
    entry_shape: tuple[int, ...]  # one token's entry in one part, e.g. (kv_heads, head_size)
    dtype: torch.dtype
    parts: int = 2  # K and V; an MLA latent cache has one

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.parts, num_blocks, self.block_size, *self.entry_shape)

    @property
    def bytes_per_token(self) -> int:
        return self.parts * math.prod(self.entry_shape) * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass
class AttentionBatch:
    """One engine step's batch, as every attention layer sees it.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
    its K/V after this step occupy the first ``seq_lens[i]`` slots of the
    blocks listed in ``block_tables[i]``, the new tokens being the last ones
    (so a query row at offset ``j`` of request ``i`` sits at position
    ``seq_lens[i] - query_len_i + j`` and attends causally up to itself).
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can plan without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> AttentionBatch:
        """Describe requests that already hold ``num_computed`` tokens in their blocks and add ``num_new``."""
        import torch

        seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
        qsl = [0]
        slots: list[int] = []
        for table, start, end in zip(block_tables, num_computed, seq_lens, strict=True):
            qsl.append(qsl[-1] + end - start)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            max_query_len=max(num_new, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Implement ``forward`` (and ``forward_mla`` for a backend that declares "mla"); override the rest only
    when the kernel needs to."""

    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def kv_cache_spec(
        self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> KVCacheSpec:
        """The layout of ``layer``'s cache for a model in ``dtype``; ``kv_cache_dtype`` is one the capabilities list.

        The default is each KV-cache dtype's standard layout (``fw.sdk.kv_quant``): K and V per KV head, or for MLA
        the latent and the rotary key in one part. Override it only for a layout of the backend's own.
        """
        from fw.sdk import kv_quant  # imports torch: never at module level, where listing plugins reads this file

        if layer.mla is not None:
            heads, row, parts = 1, layer.mla.kv_lora_rank + layer.mla.qk_rope_head_dim, 1
        else:
            heads, row, parts = layer.num_kv_heads, layer.head_size, 2
        stored, row = kv_quant.storage(kv_cache_dtype, dtype, row)
        return KVCacheSpec(block_size, (heads, row), stored, parts)

    def prepare(self, batch: AttentionBatch) -> Any:
        """Once per step, before any layer runs: build backend metadata."""
        return batch

    def supports_decode_graphs(self) -> bool:
        """Whether ``prepare`` and ``forward`` of a decode batch (each request adds at most
        ``GRAPH_MAX_QUERY_LEN`` tokens: one, or one and the speculative drafts it verifies), after its first step,
        depend on the batch's tensors and its counts of requests and tokens alone, not on its other host-side
        values (``seq_lens_cpu``, ``query_start_loc_cpu``, ``max_seq_len``): then the runner may record such a step
        once and replay it on new tensors (``fw.decode_graph``)."""
        return False

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # this layer's cache, as kv_cache_spec laid it out
        metadata: Any,  # what prepare() returned
    ) -> torch.Tensor:
        """Write k/v into ``kv_cache`` at ``slot_mapping``, then attend. Returns [T, num_heads, head_size]."""

    def forward_mla(
        self,
        layer: AttentionLayerSpec,  # layer.mla is set; layer.scale includes YaRN's mscale
        q_nope: torch.Tensor,  # [T, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [T, num_heads, qk_rope_head_dim], rotated
        kv_latent: torch.Tensor,  # [T, kv_lora_rank], after kv_a_layernorm
        k_pe: torch.Tensor,  # [T, qk_rope_head_dim], rotated, shared by every head
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, kv_lora_rank]: latent -> each head's K without rope
        w_uv: torch.Tensor,  # [num_heads, kv_lora_rank, v_head_dim]: latent -> each head's V
        kv_cache: torch.Tensor,  # this layer's cache, as kv_cache_spec laid it out
        metadata: Any,  # what prepare() returned
    ) -> torch.Tensor:
        """Multi-head latent attention (backends that declare the "mla" feature): write ``kv_latent || k_pe``
        into ``kv_cache`` at ``slot_mapping``, then attend with, per head, K = [latent @ W_UK^T, k_pe] and
        V = latent @ W_UV. ``w_uk`` / ``w_uv`` are the per-head blocks of the layer's ``kv_b_proj``, so a
        backend may expand the latent (prefill) or fold them into the query and output (decode).
        Returns [T, num_heads, v_head_dim]."""
        raise NotImplementedError(f"attention backend {type(self).__name__} does not implement MLA (forward_mla)")
