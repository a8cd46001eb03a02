"""Speculative decoding (fw.engine.spec_decode) end to end: greedy output token for token the same as without it,
sampled output with the target's distribution (a chi-square test, with a biased proposer the rule must correct and
a wrong rule the test must catch), the lifecycle under preemption, and the refusals."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch

from conftest import run_fw
from fw import LLM, SamplingParams
from fw.config import ConfigError
from fw.engine import EngineError
from fw.engine.spec_decode import rejection_sample
from fw.inputs import TokensPrompt
from fw.interfaces.sampler import Sampler
from fw.interfaces.spec_proposer import Proposal, SpecProposer
from fw.sdk.sampler import DefaultSampler
from fw.sdk.sampling_params import StructuredOutputsParams
from fw.testing.models import make_tiny_model
from fw.testing.speculation import TEXTS, assert_same, check_greedy_exact, mixed_requests, run_all

# Drafting at every batch size: the CPU's default stops above 4 running requests.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 1 << 16}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("spec") / "llama"))


@pytest.mark.parametrize(
    "batch,settings",
    [
        (1, {}),
        (8, {}),
        (8, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 0}),  # chunked prefill, drafts cut short
        (32, {"enable_prefix_caching": False}),
        (32, {"num_kv_blocks": 16, "max_model_len": 128}),  # preemption mid-run, prefix caching on
    ],
)
def test_greedy_is_token_exact(model, batch, settings):
    llm = check_greedy_exact(model, NGRAM, batch, settings)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0, "no draft was ever accepted: the test checks nothing"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft was ever rejected: the rollback is untested"
    assert llm.llm_engine.kv.num_free_blocks() == settings.get("num_kv_blocks", 256), "a rejected draft's block leaked"


def test_stop_conditions_hold_token_by_token(model):
    """A stop token or string inside an accepted run of drafts ends the request there, as without speculation."""
    prompt = TEXTS[0] * 2
    base = LLM(model, dtype="float32", num_kv_blocks=64)
    plain = base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    # A token that first occurs late, after drafts had their chance, and its text as a stop string.
    ids = plain.token_ids
    stop_token = next(t for i, t in enumerate(ids) if i >= 6 and t not in ids[:i])
    stop_string = base.get_tokenizer().decode([stop_token])
    assert plain.text.find(stop_string) > len(base.get_tokenizer().decode(ids[:6]))
    stops = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_string]),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, stop_token_ids=[stop_token]),
    ]
    reference = [o.outputs[0] for o in base.generate([prompt] * 3, stops, use_tqdm=False)]
    llm = LLM(model, dtype="float32", num_kv_blocks=64, speculative_config=NGRAM)
    outputs = [o.outputs[0] for o in llm.generate([prompt] * 3, stops, use_tqdm=False)]
    assert_same(outputs, reference)
    assert [o.text for o in outputs] == [o.text for o in reference]
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0


# --- sampled output: the target's distribution --------------------------------------------------------------------

ALLOWED = [100, 101, 102, 103]  # a four-token vocabulary (allowed_token_ids), so that every outcome is counted
PROMPT = [100, 101, 102, 100, 101, 102, 100, 101]
TEMPERATURE = 0.8
SAMPLES = 4000
LENGTH = 3  # the joint distribution of the first 3 tokens: 64 outcomes, the 2nd and 3rd verified from drafts


@pytest.fixture(scope="module")
def exact(model) -> dict[tuple[int, ...], float]:
    """The target's probability of every 3-token continuation, from transformers at temperature 0.8 over ALLOWED."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    allowed = torch.tensor(ALLOWED)
    out = {}
    for tokens in itertools.product(ALLOWED, repeat=LENGTH):
        ids = torch.tensor([PROMPT + list(tokens)])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(PROMPT) - 1 : len(PROMPT) - 1 + LENGTH][:, allowed]
        probs = (logits / TEMPERATURE).softmax(-1)
        out[tokens] = math.prod(float(probs[i, ALLOWED.index(t)]) for i, t in enumerate(tokens))
    return out


def sample_counts(llm: LLM) -> Counter:
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=LENGTH + 1, allowed_token_ids=ALLOWED, seed=i, ignore_eos=True)
        for i in range(SAMPLES)
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * SAMPLES, params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[:LENGTH]) for o in outputs)


def chi_square(counts: Counter, exact: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """Pearson's statistic against the exact distribution (outcomes expected fewer than 5 times pooled), and its
    0.1% critical value (Wilson-Hilferty)."""
    cells, pooled = [], [0, 0.0]
    for outcome, p in exact.items():
        if SAMPLES * p < 5:
            pooled[0] += counts[outcome]
            pooled[1] += SAMPLES * p
        else:
            cells.append((counts[outcome], SAMPLES * p))
    cells.append(tuple(pooled))
    assert sum(counts.values()) == SAMPLES and set(counts) <= set(exact)
    stat = sum((seen - want) ** 2 / want for seen, want in cells if want > 0)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


class BiasedProposer(SpecProposer):
    """Drafts sampled from a fixed distribution far from the target's (mostly ALLOWED[0]), with that q."""

    def __init__(self, vocab_size: int, deterministic: bool = False) -> None:
        self.num_speculative_tokens = 3
        self.q = torch.zeros(vocab_size)
        self.q[ALLOWED] = torch.tensor([0.7, 0.1, 0.1, 0.1])
        self.deterministic = deterministic
        self.generator = torch.Generator().manual_seed(0)

    def propose(self, requests):
        if self.deterministic:  # always ALLOWED[0]: q one-hot, probs None
            return [Proposal([ALLOWED[0]] * r.k) for r in requests]
        proposals = []
        for r in requests:
            tokens = torch.multinomial(self.q, r.k, replacement=True, generator=self.generator).tolist()
            proposals.append(Proposal(tokens, self.q.expand(r.k, -1).clone()))
        return proposals


def always_accept(p, drafts, q, generator):
    """A wrong acceptance rule: every draft kept, then a token from p."""
    return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


@pytest.fixture(scope="module")
def spec_llm(model):
    """An engine with speculation, and its proposers by name (a test installs the one it needs)."""
    llm = LLM(model, dtype="float32", num_kv_blocks=512, max_model_len=64, speculative_config=NGRAM)
    vocab = llm.llm_engine.view.vocab_size
    yield llm, {"ngram": llm.llm_engine.spec.proposer, "biased": BiasedProposer(vocab),
                "biased-deterministic": BiasedProposer(vocab, deterministic=True)}
    llm.shutdown()


def test_sampling_without_speculation_fits_the_exact_distribution(model, exact):
    stat, critical = chi_square(sample_counts(LLM(model, dtype="float32", num_kv_blocks=512, max_model_len=64)), exact)
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize("proposer", ["ngram", "biased", "biased-deterministic"])
def test_sampling_with_speculation_keeps_the_distribution(spec_llm, exact, proposer):
    llm, proposers = spec_llm
    engine = llm.llm_engine
    engine.spec.proposer = proposers[proposer]
    before = engine.stats().spec_decode
    stat, critical = chi_square(sample_counts(llm), exact)
    after = engine.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens > SAMPLES // 4, "too few drafts accepted to test"
    assert after.num_draft_tokens - before.num_draft_tokens > after.num_accepted_tokens - before.num_accepted_tokens
    assert stat < critical, (stat, critical)


def test_the_chi_square_test_catches_a_wrong_acceptance_rule(spec_llm, exact):
    llm, proposers = spec_llm
    engine = llm.llm_engine
    engine.spec.proposer = proposers["biased"]
    engine.spec.rule = always_accept
    try:
        stat, critical = chi_square(sample_counts(llm), exact)
    finally:
        engine.spec.rule = rejection_sample
    assert stat > critical, (stat, critical)


# --- the proposer's lifecycle and what it is given ----------------------------------------------------------------


class RecordingProposer(SpecProposer):
    """Drafts nothing; keeps each request's hidden states as a proposer with its own KV would, and what it saw."""

    needs_hidden_states = True

    def __init__(self) -> None:
        self.num_speculative_tokens = 2
        self.states: dict[str, list[torch.Tensor]] = {}
        self.seen: list[tuple[list[int], torch.Tensor]] = []  # (token ids, every state held) at each ask
        self.removed: list[str] = []

    def propose(self, requests):
        for r in requests:
            self.states.setdefault(r.request_id, []).append(r.hidden_states)
            self.seen.append((list(r.token_ids), torch.cat(self.states[r.request_id])))
        return [Proposal([]) for _ in requests]

    def remove_request(self, request_id):
        self.removed.append(request_id)
        self.states.pop(request_id, None)


def test_hidden_states_cover_every_position_and_preemption_resets(model):
    llm = LLM(model, dtype="float32", num_kv_blocks=6, max_model_len=96, enable_prefix_caching=False,
              max_num_batched_tokens=32, long_prefill_token_threshold=0, speculative_config=NGRAM)
    engine = llm.llm_engine
    proposer = engine.spec.proposer = RecordingProposer()
    prompts, _ = mixed_requests(4)
    _, preempted = run_all(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=30)] * 4)
    assert preempted > 0
    runner = engine.executor.runner
    for token_ids, states in proposer.seen:
        # Since the start or the latest preemption, every position (no prefix cache), the whole prompt included
        # despite chunked prefill; the last row predicted the last token.
        assert states.shape[0] == len(token_ids) - 1
        assert int(runner.model.compute_logits(states[-1:]).argmax()) == token_ids[-1]
    assert len(proposer.removed) > 4  # the finished ones, and the preempted ones before that


def test_speculation_stops_above_the_batch_size_threshold(model):
    llm = LLM(model, dtype="float32", num_kv_blocks=128,
              speculative_config={**NGRAM, "disable_by_batch_size": 2})
    prompts, params = mixed_requests(4)
    same = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 4
    llm.generate(prompts, same, use_tqdm=False)
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens == 0
    llm.generate(prompts[:1], same[:1], use_tqdm=False)
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0


def test_unset_the_cpu_stops_speculation_above_4_requests(model):
    unset = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
    llm = LLM(model, dtype="float32", num_kv_blocks=128, speculative_config=unset)
    prompts, _ = mixed_requests(5)
    same = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 5
    llm.generate(prompts, same, use_tqdm=False)  # 5 requests running together to their ends
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens == 0
    llm.generate(prompts[:4], same[:4], use_tqdm=False)
    assert llm.llm_engine.stats().spec_decode.num_draft_tokens > 0


def test_metrics_count_drafts(model):
    from fw_cli.server.metrics import Metrics

    llm = LLM(model, dtype="float32", num_kv_blocks=64, speculative_config=NGRAM)
    llm.generate([TEXTS[0]], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    text = Metrics(llm.llm_engine).render().decode()
    stats = llm.llm_engine.stats().spec_decode
    assert f"fw:spec_decode_num_draft_tokens_total {float(stats.num_draft_tokens)}" in text
    assert f"fw:spec_decode_num_accepted_tokens_total {float(stats.num_accepted_tokens)}" in text
    assert "spec_decode" not in Metrics(LLM(model, num_kv_blocks=64).llm_engine).render().decode()


# --- bad input ----------------------------------------------------------------------------------------------------


def test_bad_configurations_name_the_option(model):
    with pytest.raises(EngineError, match=r"speculative_config\.method: unknown spec_proposers plugin 'nope' \(available: .*ngram"):
        LLM(model, num_kv_blocks=64, speculative_config={"method": "nope", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative_config\.num_speculative_tokens"):
        LLM(model, num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(EngineError, match=r"speculative_config\.num_speculative_tokens 64: .* from 1 to 15"):
        LLM(model, num_kv_blocks=64, max_num_batched_tokens=16, long_prefill_token_threshold=0,
            speculative_config={"method": "ngram", "num_speculative_tokens": 64})
    with pytest.raises(EngineError, match=r"num_speculative_tokens is required"):
        LLM(model, num_kv_blocks=64, speculative_config={"method": "ngram"})
    with pytest.raises(EngineError, match=r"speculative_config \(ngram options\): prompt_lookup_mx"):
        LLM(model, num_kv_blocks=64, speculative_config={**NGRAM, "prompt_lookup_mx": 2})
    with pytest.raises(ConfigError, match=r"speculative_config\.method \(e\.g\. ngram\) or speculative_config\.model"):
        LLM(model, num_kv_blocks=64, speculative_config={"num_speculative_tokens": 2})



def test_a_sampler_without_probabilities_is_refused(model, monkeypatch):
    monkeypatch.setattr(DefaultSampler, "probabilities", Sampler.probabilities)
    with pytest.raises(EngineError, match=r"sampler 'default' does not give its probabilities"):
        LLM(model, num_kv_blocks=64, sampler="default", speculative_config=NGRAM)


def test_what_speculation_cannot_keep_exact_is_refused_by_name(model):
    llm = LLM(model, num_kv_blocks=64, speculative_config=NGRAM)
    with pytest.raises(EngineError, match="structured output with speculative decoding is not supported"):
        llm.llm_engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+")))


def test_the_flag_takes_json():
    config = json.dumps(NGRAM)
    out = run_fw("config", "show", "--speculative-config", config)
    assert out.returncode == 0, out.stderr
    assert "num_speculative_tokens: 4" in out.stdout and "prompt_lookup_max: 3" in out.stdout
    bad = run_fw("config", "show", "--speculative-config", "{method: ngram")
    assert bad.returncode != 0 and "speculative_config" in bad.stderr and "not JSON" in bad.stderr
