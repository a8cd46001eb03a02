"""Unquantized linear layers: the checkpoint's weights as they are."""
