"""Attention backend interface (plugin kind ``fw.attention``).

The core owns the paged KV cache layout in blocks; a backend owns the kernel.
Once per engine step the model runner describes the batch as an
``AttentionBatch``; the backend may turn it into its own metadata in
``prepare`` (FlashInfer's plan(), say), and every attention layer then calls
``forward`` with that metadata. Tokens of all requests are flattened into one
dimension, prefill chunks and decodes mixed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.base import Capabilities, Requirements

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

API_VERSION = 1

# Feature flags a backend may declare in ``AttentionCapabilities.features``.
FEATURES = frozenset({"sliding_window", "mla", "fp8_kv", "cuda_graph", "soft_cap"})


@dataclass(frozen=True)
class AttentionCapabilities(Capabilities):
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    head_sizes: frozenset[int] | None = None  # None: any head size
    block_sizes: frozenset[int] | None = None  # None: any block size

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "features": FEATURES}

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
        needed = set(req.attention_features)
        if req.mla:
            needed.add("mla")
        if req.sliding_window:
            needed.add("sliding_window")
        for feature in sorted(needed - self.features):
            out.append(f"does not support {feature}")
        return out


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static shape of one attention layer, fixed at model construction."""

    num_heads: int  # query heads on this tensor-parallel rank
    num_kv_heads: int  # KV heads on this rank
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent keys
    layer_idx: int = 0


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
    """Implement ``forward``; override the rest only when the kernel needs to."""

    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor; index 0 is K, 1 is V."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def prepare(self, batch: AttentionBatch) -> Any:
        """Once per step, before any layer runs: build backend metadata."""
        return batch

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # this layer's cache, shaped by kv_cache_shape
        metadata: Any,  # what prepare() returned
    ) -> torch.Tensor:
        """Write k/v into ``kv_cache`` at ``slot_mapping``, then attend. Returns [T, num_heads, head_size]."""
