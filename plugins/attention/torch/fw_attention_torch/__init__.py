"""Paged attention in plain torch: the reference every other attention backend is checked against."""
