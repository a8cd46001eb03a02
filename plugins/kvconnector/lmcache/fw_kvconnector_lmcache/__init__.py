"""Keep prompt-prefix KV blocks in LMCache's storage: its CPU RAM, local-disk or lm:// server backend."""
