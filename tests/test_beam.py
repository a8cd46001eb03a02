"""Beam search (sampler plugin `beam`) against a brute-force beam search scored by transformers."""

from __future__ import annotations

import pytest
import torch

from fw import LLM
from fw.sdk.sampling_params import BeamSearchParams
from fw.testing.conformance import SamplerConformance
from fw.testing.models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("beam") / "qwen2")


def brute_force(hf, prompt: list[int], params: BeamSearchParams, eos: int) -> list[tuple[list[int], float]]:
    """Beam search that expands every vocabulary token of every beam, scoring with a full forward pass."""
    live, done = [([], 0.0)], []
    for _ in range(params.max_tokens):
        if not live:
            break
        cands = []
        for tokens, score in live:
            logprobs = hf(torch.tensor([prompt + tokens])).logits[0, -1].float().log_softmax(-1)
            for tok in logprobs.argsort(descending=True).tolist():
                cands.append((tokens + [tok], score + logprobs[tok].item(), tok == eos and not params.ignore_eos))
        cands.sort(key=lambda c: -c[1])
        live = []
        for tokens, score, finished in cands:
            if finished:
                done.append((tokens, score))
            elif len(live) < params.beam_width:
                live.append((tokens, score))
            if len(live) == params.beam_width:
                break
        if params.early_stopping and len(done) >= params.beam_width:
            live = []
    ranked = sorted(done + live, key=lambda c: -c[1] / len(c[0]) ** params.length_penalty)
    return ranked[: params.beam_width]


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True),
        BeamSearchParams(beam_width=4, max_tokens=4, length_penalty=0.5, early_stopping=True),
    ],
)
def test_beam_search_equals_brute_force(model, params):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    llm = LLM(model, sampler="beam", num_kv_blocks=128, max_model_len=128)
    prompts = ["The quick brown", "def f(x):"]
    with torch.no_grad():
        outputs = llm.beam_search(prompts, params)
        for prompt, out in zip(prompts, outputs, strict=True):
            ids = llm.get_tokenizer().encode(prompt)
            expected = brute_force(hf, ids, params, llm.get_tokenizer().eos_token_id)
            assert [s.token_ids for s in out.sequences] == [tokens for tokens, _ in expected]
            for seq, (_, score) in zip(out.sequences, expected, strict=True):
                assert seq.cum_logprob == pytest.approx(score, abs=1e-4)


def test_beam_search_needs_a_beam_sampler(model):
    llm = LLM(model, num_kv_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match="needs a sampler with the 'beam' feature"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2))


def test_beam_sampler_serves_ordinary_requests_like_default(model):
    from fw import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(model, sampler="beam", num_kv_blocks=64, max_model_len=128).generate(["Hello"], greedy)
    b = LLM(model, num_kv_blocks=64, max_model_len=128).generate(["Hello"], greedy)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


class TestBeamConformance(SamplerConformance):
    plugin = "beam"
