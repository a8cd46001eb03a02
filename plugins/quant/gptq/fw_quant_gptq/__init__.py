"""4- and 8-bit integer weights: GPTQ and compressed-tensors pack-quantized checkpoints, and the kernels (CPU and Triton) that fw-quant-awq shares."""
