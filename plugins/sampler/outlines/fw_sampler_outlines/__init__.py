"""Structured output (JSON schema, JSON object, regex, choice) on top of the default sampler, via outlines-core."""
