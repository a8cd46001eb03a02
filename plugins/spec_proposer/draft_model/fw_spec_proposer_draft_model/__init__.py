"""The draft-model speculative-decoding proposer."""
