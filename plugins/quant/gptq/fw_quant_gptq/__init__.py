"""4- and 8-bit integer weights: GPTQ, AWQ and compressed-tensors pack-quantized checkpoints, and their kernels (CPU and Triton)."""
