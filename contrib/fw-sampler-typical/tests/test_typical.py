import torch

from fw.testing.conformance import SamplerConformance
from fw_sampler_typical.sampler import typical_filter


class TestTypicalConformance(SamplerConformance):
    plugin = "typical"
    options = {"mass": 0.5}


def test_keeps_the_tokens_closest_to_the_entropy():
    # p = [0.5, 0.3, 0.2]: entropy 1.03 nats; surprises 0.69, 1.20, 1.61 -> distances 0.34, 0.17, 0.58.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = typical_filter(logits, 0.25).isfinite()
    assert kept.tolist() == [[False, True, False]]
    kept = typical_filter(logits, 0.5).isfinite()
    assert kept.tolist() == [[True, True, False]]
