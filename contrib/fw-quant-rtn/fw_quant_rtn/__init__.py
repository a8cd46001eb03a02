"""Round-to-nearest int8 weight-only quantization for Flywheel: an example quant plugin to copy (fw-quant-fp8's int8
plugin is the built-in one, with checkpoints, W8A8 and native kernels)."""
