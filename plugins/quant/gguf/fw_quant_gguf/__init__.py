"""llama.cpp GGUF checkpoints: config, weights and tokenizer from one file; linear weights stay in their blocks."""
