"""Reasoning parsers for models that think in ``<think>...</think>`` before they answer."""
