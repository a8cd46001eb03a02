"""FlashAttention-2 (and FlashAttention-3 on Hopper) paged-KV attention for CUDA GPUs.

Imports only fw.plugins / fw.interfaces: listing plugins must not load torch or flash-attn.

One record serves both versions, so it states what FA2 accepts; FA3 (used instead on compute capability 9.x when
``flash_attn_interface`` imports) accepts all of it too, and more (any block size) that the record does not claim.
"""

from fw.interfaces import attention
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec

# FA2's paged path refuses a page (block) size not divisible by 256 (csrc/flash_attn/flash_api.cpp). The record
# holds a finite set: the multiples of 256 up to 2048.
BLOCK_SIZES = frozenset(range(256, 2049, 256))

SPEC = PluginSpec(
    name="flash_attn",
    kind="attention",
    impl="fw_attention_flash_attn.backend:FlashAttnAttention",
    capabilities=attention.AttentionCapabilities(
        devices=frozen("cuda"),
        min_compute_capability=(8, 0),  # FA2; FA3 needs 9.0 and is only tried there
        dtypes=frozen("bfloat16", "float16"),
        # Both kernels take multiples of 8 up to 256; FA2's wrapper would pad other sizes, copying the whole cache.
        head_sizes=frozenset(range(8, 257, 8)),
        block_sizes=BLOCK_SIZES,
        features=frozen("sliding_window", "soft_cap"),
        # No fp8: FA2 has none, and FA3 reads fp8 K/V only with an fp8 query, which needs a query scale fw lacks.
        kv_cache_dtypes=frozen("auto"),
        requires_modules=("flash_attn",),
    ),
    api_version=1,
    description=(
        "FlashAttention paged-KV attention (flash-attn >= 2.6; FA3's kernels on Hopper when installed): mixed "
        "prefill chunks and decodes, GQA, sliding window, logit soft cap; needs a CUDA GPU with compute "
        "capability >= 8.0, the flash-attn package and a block size divisible by 256 (--block-size 256)."
    ),
    # Between FlashInfer (20) and torch (10): upstream FA2 pages only in 256-token blocks and reads no fp8 cache,
    # so FlashInfer stays auto's CUDA choice wherever both fit (vLLM's own FA backend uses a fork without those
    # limits); on a GPU without FlashInfer a fused kernel still beats torch. Never chosen on a CPU: cuda only.
    priority=15,
)
