"""FP8 (e4m3) weights: compressed-tensors, vLLM/AutoFP8 and DeepSeek-V3 block checkpoints, and plain ones quantized at load."""
