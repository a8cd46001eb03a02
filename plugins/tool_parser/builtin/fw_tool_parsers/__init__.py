"""Tool-call parsers for the formats of the Hermes/Qwen, Llama 3, Mistral and Llama 3.2-style pythonic models."""
