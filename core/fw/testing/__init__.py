"""Helpers for testing Flywheel and its plugins: tiny random-weight checkpoints with real tokenizers."""
