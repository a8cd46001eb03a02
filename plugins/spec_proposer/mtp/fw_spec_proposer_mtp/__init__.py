"""The multi-token-prediction (DeepSeek-V3 MTP) speculative-decoding proposer."""
