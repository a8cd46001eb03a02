"""fw's point-to-point KV connector: prompt KV from a prefill instance to a decode instance."""
