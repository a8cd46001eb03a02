"""Keep prompt-prefix KV blocks in a bounded CPU-RAM tier and a bounded disk tier, least recently used evicted."""
