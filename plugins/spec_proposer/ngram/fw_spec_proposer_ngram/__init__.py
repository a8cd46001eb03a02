"""The n-gram (prompt lookup) speculative-decoding proposer."""
