"""Tensor-parallel building blocks that the built-in models are assembled from."""
