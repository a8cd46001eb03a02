"""The draft-model proposer: greedy output token for token the same as without speculation (batches of 1, 8 and
32 mixed requests, preemption mid-run), a model drafting for itself accepted in full, its KV cache given back,
another vocabulary refused, and the spec proposer conformance suite."""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fw import LLM, SamplingParams
from fw.config import FwConfig
from fw.draft_runner import loader
from fw.engine import EngineError
from fw.interfaces import spec_proposer
from fw.testing.conformance import SpecProposerConformance
from fw.testing.models import make_tiny_model, scratch_dir, train_byte_level_bpe
from fw.testing.speculation import GREEDY_CASES, assert_same, check_greedy_exact, mixed_requests, run_all

K = 3


@cache
def _models() -> Path:
    return scratch_dir("fw-draft-model-")


@pytest.fixture(scope="module")
def target() -> str:
    return str(make_tiny_model("LlamaForCausalLM", _models() / "target"))


@pytest.fixture(scope="module")
def draft(target) -> str:
    """The target with noise on every weight: a model that agrees with it on some tokens, not all (a random
    model's next token is chaotic enough that a smaller one agrees on none)."""
    path = _models() / "draft"
    shutil.copytree(target, path)
    generator = torch.Generator().manual_seed(1)
    weights = load_file(path / "model.safetensors")
    noisy = {name: w + 0.01 * torch.randn(w.shape, generator=generator) for name, w in weights.items()}
    save_file(noisy, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def speculative(path: str, **extra) -> dict:
    """Drafting at every batch size (the CPU's default stops above 4 running requests)."""
    return {"model": path, "num_speculative_tokens": K, "disable_by_batch_size": 1 << 16, **extra}


class TestDraftModelProposer(SpecProposerConformance):
    plugin = "draft_model"
    num_speculative_tokens = K

    @property
    def options(self) -> dict:
        return {"model": str(make_tiny_model("LlamaForCausalLM", _models() / "conformance-draft", seed=3))}

    def context(self, tmp_path: Path) -> spec_proposer.ProposerContext:
        config = FwConfig(model={"model": str(self.target(tmp_path)), "device": "cpu", "dtype": "float32"},
                          cache={"num_kv_blocks": 64})
        return spec_proposer.ProposerContext(
            **{**super().context(tmp_path).__dict__, "config": config, "load_draft": loader(config, "cpu")}
        )


@pytest.mark.parametrize("batch,settings", GREEDY_CASES)
def test_greedy_is_token_exact(target, draft, batch, settings):
    llm = check_greedy_exact(target, speculative(draft), batch, settings)
    stats = llm.llm_engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts must be both accepted and rejected"
    runner = llm.llm_engine.spec.proposer.runner
    assert runner.kv.num_free_blocks() == runner.runner.num_blocks, "the draft cache kept blocks of finished requests"


def test_a_model_drafting_for_itself_is_accepted_in_full(target):
    """Plain greedy requests (penalties would change the target's choice, not the draft's)."""
    prompts, _ = mixed_requests(8)
    params = [SamplingParams(temperature=0.0, max_tokens=40)] * len(prompts)
    llm = LLM(target, speculative_config=speculative(target), num_kv_blocks=256, dtype="float32")
    run_all(llm, prompts, params)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_sampled_drafts_keep_greedy_output(target, draft):
    """Drafts sampled from the draft model report their distribution; greedy requests stay token-exact."""
    prompts, params = mixed_requests(8)
    reference, _ = run_all(LLM(target, num_kv_blocks=256, dtype="float32"), prompts, params)
    llm = LLM(target, speculative_config=speculative(draft, draft_temperature=0.8), num_kv_blocks=256, dtype="float32")
    outputs, _ = run_all(llm, prompts, params)
    assert_same(outputs, reference)
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0


def test_another_vocabulary_is_refused(target, tmp_path):
    bigger = make_tiny_model("LlamaForCausalLM", tmp_path / "bigger", vocab_size=600)
    with pytest.raises(EngineError, match=r"speculative_config.model .*vocab_size 600 is not the target's 512"):
        LLM(target, speculative_config=speculative(str(bigger)), num_kv_blocks=64)
    other = make_tiny_model("LlamaForCausalLM", tmp_path / "other")
    tokenizer = train_byte_level_bpe(["completely different words, trained apart"] * 4, 512)
    (other / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    with pytest.raises(EngineError, match=r"speculative_config.model .*tokenizer is not the target's"):
        LLM(target, speculative_config=speculative(str(other)), num_kv_blocks=64)


def test_bad_options_name_the_key(target, draft):
    with pytest.raises(Exception, match="draft_temperature"):
        LLM(target, speculative_config=speculative(draft, draft_temperature=-1), num_kv_blocks=64)
    with pytest.raises(Exception, match="no_such_key"):
        LLM(target, speculative_config=speculative(draft, no_such_key=1), num_kv_blocks=64)


def test_the_draft_config_is_the_engine_config_with_the_draft_checkpoint(target, tmp_path):
    smaller = str(make_tiny_model("LlamaForCausalLM", tmp_path / "smaller", num_hidden_layers=1))
    llm = LLM(target, speculative_config=speculative(smaller), num_kv_blocks=48, dtype="float32")
    runner = llm.llm_engine.spec.proposer.runner
    assert runner.runner.num_blocks == 48 and runner.runner.dtype == llm.llm_engine.executor.runner.dtype
    assert len(runner.runner.kv_caches) == 1  # the draft's own layer, not the target's two
