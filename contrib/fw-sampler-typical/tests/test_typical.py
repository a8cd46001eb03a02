import pytest
import torch

from fw import LLM, SamplingParams
from fw.engine import EngineError
from fw.testing.conformance import SamplerConformance
from fw.testing.models import make_tiny_model
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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("typical") / "llama"))


def sampled(llm: LLM) -> set[tuple[int, ...]]:
    """The tokens sampled at temperature 1 with three seeds."""
    outputs = [llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=1, seed=seed), use_tqdm=False)
               for seed in (1, 2, 3)]
    llm.shutdown()
    return {tuple(out[0].outputs[0].token_ids) for out in outputs}


def test_selected_it_takes_effect(model):
    # With a tiny mass only the single most typical token survives, so sampling is deterministic whatever the seed.
    engine = {"num_kv_blocks": 16, "max_model_len": 128, "device": "cpu"}
    assert len(sampled(LLM(model, sampler="typical", plugin_options={"sampler": {"mass": 1e-9}}, **engine))) == 1
    assert len(sampled(LLM(model, **engine))) > 1, "the default sampler varies with the seed"


def test_options_are_validated(model):
    with pytest.raises(EngineError, match="sampler.options: mass: Input should be less than or equal to 1"):
        LLM(model, sampler="typical", plugin_options={"sampler": {"mass": 2}}, device="cpu")
