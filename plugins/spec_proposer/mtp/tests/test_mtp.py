"""The MTP proposer on a tiny DeepSeek-V3-shaped checkpoint with a random multi-token-prediction layer: greedy
output token for token the same as without speculation (batches of 1, 8 and 32 mixed requests, preemption mid-run),
its cache given back, the head's drafts the same however the target's states arrive, the refusals, and the spec
proposer conformance suite."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fw import LLM
from fw.config import FwConfig
from fw.draft_runner import loader
from fw.engine import EngineError
from fw.interfaces import spec_proposer
from fw.step_inputs import StepInputs
from fw.testing.conformance import SpecProposerConformance
from fw.testing.models import make_tiny_model, scratch_dir
from fw.testing.speculation import GREEDY_CASES, assert_same, check_greedy_exact, mixed_requests, run_all

ARCH = "DeepseekV3ForCausalLM"
LAYERS = 3


def make_mtp_model(path: Path) -> Path:
    """A tiny DeepSeek-V3 with one MTP layer, laid out as DeepSeek-V3's checkpoint: ``model.layers.{LAYERS}`` holds
    a decoder layer (random, built as one more layer of the model) plus enorm, hnorm, eh_proj, shared_head and its
    own copy of the embedding."""
    make_tiny_model(ARCH, path, num_hidden_layers=LAYERS + 1)
    weights = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    hidden, mtp = config["hidden_size"], f"model.layers.{LAYERS}"
    generator = torch.Generator().manual_seed(7)
    weights |= {
        f"{mtp}.embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
        f"{mtp}.enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        f"{mtp}.hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        f"{mtp}.eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=generator),
        f"{mtp}.shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        f"{mtp}.shared_head.head.weight": weights["lm_head.weight"].clone(),
    }
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config |= {"num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    return path


@cache
def _model() -> str:
    return str(make_mtp_model(scratch_dir("fw-mtp-") / "deepseek"))


@pytest.fixture(scope="module")
def model() -> str:
    return _model()


MTP = {"method": "mtp", "num_speculative_tokens": 2}


class TestMTPProposer(SpecProposerConformance):
    plugin = "mtp"
    options: dict = {}
    num_speculative_tokens = 2

    def target(self, tmp_path: Path) -> Path:
        return Path(_model())

    def context(self, tmp_path: Path) -> spec_proposer.ProposerContext:
        config = FwConfig(model={"model": _model(), "device": "cpu", "dtype": "float32"}, cache={"num_kv_blocks": 64})
        return spec_proposer.ProposerContext(
            **{**super().context(tmp_path).__dict__, "config": config, "load_draft": loader(config, "cpu")}
        )


@pytest.mark.parametrize("batch,settings", GREEDY_CASES)
def test_greedy_is_token_exact(model, batch, settings):
    llm = check_greedy_exact(model, MTP, batch, settings)
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0
    runner = llm.llm_engine.spec.proposer.runner
    assert runner.kv.num_free_blocks() == runner.runner.num_blocks, "the head's cache kept blocks of finished requests"


def test_k_defaults_to_the_checkpoints_mtp_layers(model):
    llm = LLM(model, speculative_config={"method": "mtp"}, num_kv_blocks=64, dtype="float32")
    assert llm.llm_engine.spec.k == 1
    assert len(llm.llm_engine.spec.proposer.runner.runner.kv_caches) == 1  # the MTP layer's cache alone


def test_a_model_without_mtp_layers_is_refused(tmp_path):
    llama = str(make_tiny_model("LlamaForCausalLM", tmp_path / "llama"))
    with pytest.raises(EngineError, match="method mtp: .*num_nextn_predict_layers"):
        LLM(llama, speculative_config=MTP, num_kv_blocks=64)


def test_eagle_is_refused_by_name(model):
    with pytest.raises(Exception, match="speculative_config.method.*eagle"):
        LLM(model, speculative_config={"method": "eagle", "num_speculative_tokens": 2}, num_kv_blocks=64)


def test_drafts_do_not_depend_on_how_the_states_arrive(model):
    """The head's cache is exact: drafts from a prompt's states handed over in pieces, with a proposal between
    them, are those from the states handed over at once."""
    prompt = mixed_requests(1)[0][0]
    engine = LLM(model, speculative_config=MTP, num_kv_blocks=64, dtype="float32").llm_engine
    tokens = engine.tokenizer.encode(prompt) + [5, 9]
    # The target's final hidden states at every position, from one forward pass over the whole sequence.
    runner = engine.executor.runner
    engine.kv.allocate_slots("h", len(tokens))
    runner.execute(StepInputs(tokens, [0], [len(tokens)], [engine.kv.block_ids("h")], [0], [len(tokens) - 1], [],
                              keep_hidden_states=True))
    states = runner.hidden_states.clone()
    proposer = engine.spec.proposer
    whole = proposer.propose([spec_proposer.ProposalRequest("a", tokens, len(tokens), 2, states[:-1])])
    cut = len(tokens) - 3
    proposer.propose([spec_proposer.ProposalRequest("b", tokens[:cut + 1], len(tokens), 2, states[:cut])])
    pieces = proposer.propose([spec_proposer.ProposalRequest("b", tokens, len(tokens), 2, states[cut:-1])])
    assert pieces[0].token_ids == whole[0].token_ids and len(whole[0].token_ids) == 2


def test_sampled_drafts_report_their_distribution(model):
    prompts, params = mixed_requests(4)
    reference, _ = run_all(LLM(model, num_kv_blocks=128, dtype="float32"), prompts, params)
    llm = LLM(model, speculative_config={**MTP, "draft_temperature": 1.0}, num_kv_blocks=128, dtype="float32")
    outputs, _ = run_all(llm, prompts, params)
    assert_same(outputs, reference)
    requests = [spec_proposer.ProposalRequest("x", [3, 4, 5], 3, 2, torch.zeros(2, 64))]
    (proposal,) = llm.llm_engine.spec.proposer.propose(requests)
    assert proposal.probs is not None and tuple(proposal.probs.shape) == (2, 512)
