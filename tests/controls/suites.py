"""The conformance suites against the broken plugins; run by test_conformance_controls.py, never collected alone."""

from fw.testing.conformance import (
    AttentionConformance,
    CommConformance,
    HooksConformance,
    KVConnectorConformance,
    QuantConformance,
    QuantFixture,
    SamplerConformance,
    plain_checkpoint,
)


class TestAttention(AttentionConformance):
    plugin = "broken"


class TestQuant(QuantConformance):
    plugin = "broken"
    # What int8 weights reach when the scales are applied: the failure is the bug's, not a tight tolerance's.
    fixtures = {"none": QuantFixture(plain_checkpoint, 0.02)}


class TestComm(CommConformance):
    plugin = "broken"


class TestKVConnector(KVConnectorConformance):
    plugin = "broken"


class TestSampler(SamplerConformance):
    plugin = "broken"


class TestHooks(HooksConformance):
    plugin = "broken"
