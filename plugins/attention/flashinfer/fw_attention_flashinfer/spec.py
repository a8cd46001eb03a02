"""FlashInfer paged-KV attention for CUDA GPUs (Ampere or newer).

Imports only fw.plugins / fw.interfaces: listing plugins must not load torch or FlashInfer.
"""

from fw.interfaces import attention
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec

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
    api_version=1,
    description=(
        "FlashInfer paged-KV attention (mixed prefill chunks and decodes, GQA, sliding window, logit soft cap, "
        "fp8 KV cache); "
        "needs a CUDA GPU with compute capability >= 8.0 and the flashinfer-python package."
    ),
    # Above the portable torch backend (BUILTIN_PRIORITY), so "auto" picks FlashInfer wherever it fits.
    priority=20,
)

# FlashInfer's MLA kernel, a plugin of its own: its record differs in every field that matters (MLA models only,
# DeepSeek-V2/V3's latent widths, no fp8 cache), and "auto" must not weigh it against the standard kernel.
SPEC_MLA = PluginSpec(
    name="flashinfer_mla",
    kind="attention",
    impl="fw_attention_flashinfer.backend:FlashInferAttention",
    capabilities=attention.AttentionCapabilities(
        devices=frozen("cuda"),
        min_compute_capability=(8, 0),
        dtypes=frozen("bfloat16", "float16"),
        features=frozen("mla"),
        mla_only=True,
        # The FA2/FA3 MLA kernels are built for DeepSeek's latent (512) and rotary key (64) widths.
        mla_dims=frozenset({(512, 64)}),
        requires_modules=("flashinfer",),
    ),
    api_version=1,
    description=(
        "FlashInfer multi-head latent attention (DeepSeek-V2/V3: kv_lora_rank 512, qk_rope_head_dim 64), absorbed, "
        "for mixed prefill chunks and decodes; needs a CUDA GPU with compute capability >= 8.0 and flashinfer-python."
    ),
    priority=20,
)
