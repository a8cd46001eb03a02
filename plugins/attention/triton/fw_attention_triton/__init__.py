"""Flywheel attention plugin: paged attention in Triton (fw_attention_triton.kernel)."""
