"""Triton paged attention for CUDA GPUs; on a CPU only in Triton's interpreter (``TRITON_INTERPRET=1``), for tests.

Imports only fw.plugins / fw.interfaces: listing plugins must not load torch or Triton.

The record depends on the interpreter because what runs does: interpreted, the kernel runs on the CPU, in
float32 only (the interpreter's 16-bit ``tl.dot`` is wrong), and far too slowly for "auto" ever to prefer it.
"""

import os

from fw.interfaces import attention
from fw.interfaces.base import frozen
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

SPEC = PluginSpec(
    name="triton",
    kind="attention",
    impl="fw_attention_triton.backend:TritonAttention",
    capabilities=attention.AttentionCapabilities(
        devices=frozen("cuda", "cpu") if INTERPRETED else frozen("cuda"),
        dtypes=frozen("float32") if INTERPRETED else frozen("float32", "bfloat16", "float16"),
        # A block is one key tile of the kernel: tl.dot needs 16 or more, tl.arange a power of two.
        block_sizes=frozenset({16, 32, 64, 128}),
        features=frozen("sliding_window", "soft_cap", "mla"),
        kv_cache_dtypes=frozen("auto", "fp8", "int8"),
        requires_modules=("triton",),
    ),
    api_version=1,
    description=(
        "Triton paged attention: one kernel for mixed prefill chunks and decodes, GQA, any head size, sliding "
        "window, logit soft cap, fp8 and int8 KV caches, and multi-head latent attention (absorbed); block sizes "
        "16-128. Needs a CUDA GPU, or on a CPU TRITON_INTERPRET=1 (float32, for testing)."
    ),
    # On a GPU above torch and below the vendor kernels (flash_attn 15, flashinfer 20); interpreted, below torch.
    priority=BUILTIN_PRIORITY - 5 if INTERPRETED else 12,
)
