"""AWQ (GEMM layout) 4-bit checkpoints, computed by fw-quant-gptq's integer layers and kernels."""
