"""Llama 3.1's custom-tool call format as a Flywheel tool-call parser: an example to copy."""
