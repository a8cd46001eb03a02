"""8-bit weights: FP8 (e4m3: compressed-tensors, vLLM/AutoFP8 and DeepSeek-V3 block checkpoints) and INT8
(compressed-tensors int-quantized, with integer W8A8 products), and plain checkpoints quantized at load."""
