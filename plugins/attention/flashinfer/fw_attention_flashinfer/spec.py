"""FlashInfer paged-KV attention for CUDA GPUs (Ampere or newer).

Imports only fw.plugins / fw.interfaces: listing plugins must not load torch or FlashInfer.
"""

from fw.interfaces import attention
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec

SPEC = PluginSpec(
    name="flashinfer",
    kind="attention",
    impl="fw_attention_flashinfer.backend:FlashInferAttention",
    capabilities=attention.AttentionCapabilities(
        devices=frozen("cuda"),
        min_compute_capability=(8, 0),
        dtypes=frozen("bfloat16", "float16"),
        head_sizes=frozenset({64, 128, 256}),
        features=frozen("sliding_window", "soft_cap"),
        kv_cache_dtypes=frozen("auto", "fp8"),
        requires_modules=("flashinfer",),
    ),
    api_version=attention.API_VERSION,
    description=(
        "FlashInfer paged-KV attention (mixed prefill chunks and decodes, GQA, sliding window, logit soft cap, "
        "fp8 KV cache); "
        "needs a CUDA GPU with compute capability >= 8.0 and the flashinfer-python package."
    ),
    # Above the portable torch backend (BUILTIN_PRIORITY), so "auto" picks FlashInfer wherever it fits.
    priority=20,
)
