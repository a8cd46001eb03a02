"""Share prompt-prefix KV blocks between engine instances through a directory."""
