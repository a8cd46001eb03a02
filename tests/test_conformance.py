"""Every built-in plugin passes the same conformance suite a third-party author runs."""

from fw.testing.conformance import (
    AttentionConformance,
    CommConformance,
    KVConnectorConformance,
    QuantConformance,
    SamplerConformance,
)


class TestTorchAttention(AttentionConformance):
    plugin = "torch"


class TestFlashInferAttention(AttentionConformance):
    plugin = "flashinfer"


class TestUnquantized(QuantConformance):
    plugin = "none"


class TestTorchComm(CommConformance):
    plugin = "torch"


class TestDiskKVConnector(KVConnectorConformance):
    plugin = "disk"


class TestDefaultSampler(SamplerConformance):
    plugin = "default"
