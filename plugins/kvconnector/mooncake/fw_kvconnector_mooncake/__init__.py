"""fw's KV connector over Mooncake's Transfer Engine: prompt KV from a prefill instance to a decode instance."""
