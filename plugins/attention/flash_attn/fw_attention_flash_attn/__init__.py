"""FlashAttention-2/3 paged-KV attention for CUDA GPUs."""
