from fw.interfaces import attention
from fw.interfaces.base import frozen
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec

SPEC = PluginSpec(
    name="torch",
    kind="attention",
    impl="fw_attention_torch.backend:TorchAttention",
    capabilities=attention.AttentionCapabilities(
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
        features=frozen("sliding_window", "mla", "soft_cap"),
        kv_cache_dtypes=frozen("auto", "fp8", "int8"),
    ),
    api_version=1,
    description=(
        "Paged prefill and decode: native CPU kernels where they measure faster, torch "
        "scaled_dot_product_attention elsewhere; any head size and block size; "
        "fp8 and int8 KV caches; logit soft cap; multi-head latent attention (DeepSeek-V2/V3)."
    ),
    priority=BUILTIN_PRIORITY,  # the portable default; a plugin installed beside it must declare more to replace it
)
