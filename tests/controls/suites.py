"""The conformance suites against the broken plugins; run by test_conformance_controls.py, never collected alone."""

from broken_plugins import quantize_rows, write_single_file

from fw.testing.conformance import (
    AttentionConformance,
    CheckpointFormatConformance,
    CommConformance,
    HooksConformance,
    KVConnectorConformance,
    QuantConformance,
    QuantFixture,
    SamplerConformance,
    SpecProposerConformance,
    plain_checkpoint,
    plain_weights,
)
from fw.testing.parser_conformance import ReasoningParserConformance, ToolParserConformance


class TestAttention(AttentionConformance):
    plugin = "broken"


def int8_weights(checkpoint, _options):
    """What the broken plugin claims to compute with: every linear weight rounded to int8 rows times their scales."""
    for name, tensor in plain_weights(checkpoint, None):
        if ".layers." in name and tensor.dim() == 2:
            q, scale = quantize_rows(tensor)
            tensor = q.float() * scale
        yield name, tensor


class TestQuant(QuantConformance):
    plugin = "broken"
    # int8 rows keep a random layer within 0.7% of its float product: the failure is the bug's, not a tolerance's.
    fixtures = {"none": QuantFixture(plain_checkpoint, int8_weights, 0.02)}


class TestComm(CommConformance):
    plugin = "broken"


class TestKVConnector(KVConnectorConformance):
    plugin = "broken"


class TestSampler(SamplerConformance):
    plugin = "broken"


class TestSpecProposer(SpecProposerConformance):
    plugin = "broken"


class TestHooks(HooksConformance):
    plugin = "broken"


class TestCheckpointFormat(CheckpointFormatConformance):
    plugin = "broken"
    fixture = staticmethod(write_single_file)


class TestToolParser(ToolParserConformance):
    plugin = "broken"
    samples = {
        'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>':
            ("Sure.\n", [("get_weather", {"city": "Paris"})]),
    }
    malformed = ['<tool_call>{"name": "get_weather", "arguments": {</tool_call>']


class TestReasoningParser(ReasoningParserConformance):
    plugin = "broken"
    samples = {"<think>Paris is in France.</think>Paris.": ("Paris is in France.", "Paris.")}
