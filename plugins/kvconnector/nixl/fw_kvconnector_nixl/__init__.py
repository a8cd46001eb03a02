"""fw's KV connector over NVIDIA's NIXL: prompt KV from a prefill instance to a decode instance."""
