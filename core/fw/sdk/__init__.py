"""The plugin SDK: what a plugin may use beyond the interfaces it implements.

Errors, weight loading, the standard KV-cache layouts, the unquantized linear
and MoE paths, kernel choice by measurement and native kernels, tokenizers and
sampling parameters. Like ``fw.interfaces`` it is a leaf: it imports nothing of
fw outside itself and the interfaces (tests/test_import_rules.py), so a plugin
that imports only these two never depends on how the engine is built.
"""
