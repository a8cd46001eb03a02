"""fw's KV connector over Mooncake: prompt KV between instances, point to point (Transfer Engine) or through a
Mooncake Store pool."""
