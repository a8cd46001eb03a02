"""The default sampler."""
