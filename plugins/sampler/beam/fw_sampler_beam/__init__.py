"""Beam search as a sampler plugin."""
