"""The fw command line."""
