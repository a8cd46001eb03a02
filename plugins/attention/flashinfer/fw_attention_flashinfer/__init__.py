"""FlashInfer paged-KV attention for CUDA GPUs."""
