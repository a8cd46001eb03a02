"""Locally typical sampling as a Flywheel sampler plugin: an example to copy."""
