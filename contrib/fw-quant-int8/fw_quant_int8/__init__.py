"""int8 weight-only quantization for Flywheel: an example quant plugin to copy."""
