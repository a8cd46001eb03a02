"""SamplingParams, the default sampler's distributions and formulas, stop strings, logprobs, n > 1."""

from __future__ import annotations

import math

import pytest
import torch

from fw import LLM, SamplingParams
from fw.detokenizer import IncrementalDetokenizer
from fw.engine import EngineError
from fw.interfaces.sampler import SamplingBatch
from fw.sdk import sampler
from fw.sdk.sampler import (
    DefaultSampler,
    apply_logit_bias_and_min_tokens,
    apply_penalties,
    apply_top_k_top_p_min_p,
)
from fw.sdk.sampling_params import SamplingParamsError
from fw.sdk.tokenizer import Tokenizer
from fw.testing.models import make_tiny_model

# A fixed toy distribution over 6 tokens.
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
N = 20000


def batch_of(params: list[SamplingParams], prompt=None, output=None, eos=None) -> SamplingBatch:
    return SamplingBatch(
        request_ids=[str(i) for i in range(len(params))],
        params=params,
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
        all_greedy=all(p.greedy for p in params),
        generators=[torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params],
        prompt_token_ids=prompt or [[]] * len(params),
        output_token_ids=output or [[]] * len(params),
        eos_token_id=eos,
    )


def chi_square_ok(counts: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    """Pearson's test at p = 0.001 over the tokens the expected distribution allows; none elsewhere."""
    support = expected_probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = expected_probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    # Critical values of chi-square at p = 0.001 for 1..5 degrees of freedom.
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[int(support.sum()) - 1]
    return stat < critical


def sample_counts(params: SamplingParams, at: list[int] | None = None, vocab: int = 6) -> torch.Tensor:
    """Counts of N draws from PROBS over a vocabulary of ``vocab``, the 6 tokens at ``at`` (all others masked)."""
    torch.manual_seed(0)
    at = at or list(range(6))
    logits = torch.full((vocab,), float("-inf"))
    logits[at] = PROBS.log()
    chunk = max(1, 2**22 // vocab)  # a few MB of logits a call
    tokens = torch.cat([DefaultSampler().sample(logits.expand(n, -1).contiguous(), batch_of([params] * n)).token_ids
                        for n in [chunk] * (N // chunk) + [N % chunk]])
    assert torch.isin(tokens, torch.tensor(at)).all()  # a masked token drawn
    return torch.bincount(tokens, minlength=vocab).float()[at]


def renorm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), renorm(PROBS**2)),
        (SamplingParams(temperature=2.0), renorm(PROBS**0.5)),
        (SamplingParams(temperature=1.0, top_k=3), renorm(PROBS * torch.tensor([1, 1, 1, 0, 0, 0.0]))),
        # Nucleus 0.6: 0.35 + 0.25 reaches it, the rest goes.
        (SamplingParams(temperature=1.0, top_p=0.6), renorm(PROBS * torch.tensor([1, 1, 0, 0, 0, 0.0]))),
        (SamplingParams(temperature=1.0, top_p=0.7), renorm(PROBS * torch.tensor([1, 1, 1, 0, 0, 0.0]))),
        # min_p 0.3: keep tokens with p >= 0.3 * 0.35 = 0.105.
        (SamplingParams(temperature=1.0, min_p=0.3), renorm(PROBS * torch.tensor([1, 1, 1, 1, 0, 0.0]))),
    ],
    ids=["t1", "t0.5", "t2", "topk3", "topp0.6", "topp0.7", "minp0.3"],
)
def test_sampling_distributions(params, expected):
    assert chi_square_ok(sample_counts(params), expected)


def test_sampling_distribution_over_a_large_vocabulary():
    """The six tokens spread over blocks of the native draw (1024 logits each, the last one short): each block's
    mass counts, masked tokens are never drawn."""
    at, vocab = [5, 1023, 1024, 2047, 2048, 3004], 3005
    assert chi_square_ok(sample_counts(SamplingParams(temperature=1.0), at, vocab), PROBS)
    assert chi_square_ok(sample_counts(SamplingParams(temperature=0.5), at, vocab), renorm(PROBS**2))


def test_chi_square_would_catch_a_wrong_distribution():
    assert not chi_square_ok(sample_counts(SamplingParams(temperature=0.5)), PROBS)


def _truncate_by_full_sort(logits, top_k, top_p, min_p):
    """The truncation rule on a sort of the whole vocabulary, as vLLM states it."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab).expand_as(logits) >= torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
    drop |= probs < min_p.unsqueeze(-1) * probs[:, :1]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def test_truncation_keeps_the_tokens_a_full_sort_keeps():
    """Top-k, top-p and min-p sort only the largest logits (sampler.CANDIDATES) where a row's set ends among them;
    rows whose set reaches past them (a flat distribution's nucleus, a top-k beyond them) are sorted whole."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 5000, 12
    peaked = torch.randn(rows, vocab, generator=gen) * 4  # nuclei of a few to a few hundred tokens
    logits = torch.cat([peaked, torch.randn(rows, vocab, generator=gen) * 0.1])  # and of thousands
    top_k = torch.tensor([0, 20, 0, 0, 50, 3000, 0, 1, 0, 7, 0, 0] * 2)
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.8, 0.95, 0.99, 1.0, 1.0, 0.3, 1.0, 0.7] * 2)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2] * 2)
    temperature = torch.rand(2 * rows, generator=gen) + 0.5
    fast = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p, temperature)
    assert torch.equal(fast, _truncate_by_full_sort(logits / temperature.unsqueeze(-1), top_k, top_p, min_p))
    kept = torch.isfinite(fast).sum(dim=-1)
    assert kept[1] == 20 and kept[7] == 1 and kept[8] == vocab  # top-k; nothing asked: the row as it was
    truncated = (top_k > 0) | (top_p < 1) | (min_p > 0)
    assert kept[truncated].min() < sampler.CANDIDATES < kept[truncated].max()  # rows sorted whole, and not


def test_greedy_takes_the_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = DefaultSampler().sample(logits, batch_of([SamplingParams(temperature=0.0)] * 8))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt, output = [[0]], [[2, 2, 3]]

    def run(**kw):
        return apply_penalties(logits.clone(), batch_of([SamplingParams(**kw)], prompt, output))[0]

    # Repetition: seen tokens (prompt 0, output 2 and 3) divide positive / multiply negative logits.
    assert run(repetition_penalty=2.0).tolist() == [1.0, -1.0, 0.25, 1.5]
    # Frequency: minus count x penalty (token 2 twice, token 3 once).
    assert run(frequency_penalty=0.5).tolist() == [2.0, -1.0, -0.5, 2.5]
    # Presence: minus the penalty once per generated token.
    assert run(presence_penalty=-1.0).tolist() == [2.0, -1.0, 1.5, 4.0]
    assert run().tolist() == logits[0].tolist()


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, 5)
    params = [SamplingParams(logit_bias={1: 5.0, "3": -2.5}), SamplingParams(min_tokens=2, stop_token_ids=[4])]
    out = apply_logit_bias_and_min_tokens(logits, batch_of(params, output=[[], [1]], eos=0))
    assert out[0].tolist() == [0.0, 5.0, 0.0, -2.5, 0.0]
    assert out[1].tolist() == [float("-inf"), 0.0, 0.0, 0.0, float("-inf")]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {5: 200}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ],
)
def test_out_of_range_values_name_the_field_and_range(kwargs, field):
    with pytest.raises(SamplingParamsError, match=f"^{field}"):
        SamplingParams(**kwargs)


# --- end to end on a tiny model ---------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("m") / "llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, num_kv_blocks=128, max_model_len=256)


def test_seeded_request_is_identical_alone_and_in_a_batch_of_16(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["The weather today"], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) if i % 2
        else SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
        for i in range(15)
    ]
    outs = llm.generate(["The weather today"] + [f"prompt number {i}" for i in range(15)], [seeded, *others])
    assert outs[0].outputs[0].token_ids == alone


def test_incremental_detokenizer_matches_full_decode(model):
    tok = Tokenizer.from_dir(str(model))
    text = "Grüße, 你好世界! 🤖 naïve café — def f(x): return x**2"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    for i, t in enumerate(ids):
        detok.append(t)
        full = tok.decode(ids[: i + 1])
        # Never emits a broken character; always a prefix of the full decode.
        assert "\ufffd" not in detok.text and full.startswith(detok.text)
    assert detok.text == tok.decode(ids)


def test_stop_string_across_tokens_is_cut_and_never_streamed(llm):
    base = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    # A two-character stop string whose first occurrence straddles a token boundary.
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    assert pieces[-1] == base.text
    candidates = [
        text[len(prev) - 1 : len(prev) + 1]
        for prev, text in zip(pieces[3:], pieces[4:], strict=False)
        if len(text) > len(prev) > 0 and base.text.find(text[len(prev) - 1 : len(prev) + 1]) == len(prev) - 1
    ]
    stop = candidates[0]
    start_of_stop = base.text.index(stop)
    engine = llm.llm_engine
    rid = engine.add_request("Once upon", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                seen.append(out.outputs[0])
    final = seen[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == base.text[:start_of_stop]
    for partial in seen:
        assert final.text.startswith(partial.text), "a streamed text showed part of the stop string"
    included = llm.generate(
        ["Once upon"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    )[0].outputs[0]
    assert included.text == base.text[: start_of_stop + len(stop)]


def test_logprobs_top_n_and_ranks(llm, model):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy: the chosen token is rank 1
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token], skip_special_tokens=False)
        top = sorted(entry.values(), key=lambda v: v.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:], strict=False))
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=False)))


def test_prompt_logprobs_match_transformers(llm, model):
    import transformers

    prompt = "The quick brown fox jumps"
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids])
    ref = hf(ids).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        token = out.prompt_token_ids[pos + 1]
        assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
        assert len(entry) <= 3


def test_n_sequences_and_repetition_detection(llm):
    out = llm.generate(["Hi"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Bias one token so strongly that greedy repeats it; 1-grams repeated 4 times end the request.
    rep = SamplingParams(temperature=0, max_tokens=30, logit_bias={42: 100}, repetition_ngram_size=1,
                         repetition_max_repeats=4, ignore_eos=True)
    comp = llm.generate(["Hi"], rep)[0].outputs[0]
    assert comp.token_ids == [42] * 4 and comp.finish_reason == "stop" and comp.stop_reason == "repetition"


def test_request_limits_are_checked(llm):
    with pytest.raises(EngineError, match=r"plus max_tokens \(300\) exceeds max_model_len \(256\)"):
        llm.generate(["Hi"], SamplingParams(max_tokens=300))
    # A tiny positive temperature is clamped (no overflow, no NaN) and acts as greedy.
    tiny = llm.generate(["Hi"], SamplingParams(temperature=1e-9, max_tokens=8, ignore_eos=True, logprobs=0))[0]
    greedy = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert math.isfinite(tiny.outputs[0].cumulative_logprob)


def test_every_eos_id_of_the_model_stops_generation(tmp_path):
    import json

    path = make_tiny_model("LlamaForCausalLM", tmp_path / "multi-eos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 300]}))
    llm = LLM(path, num_kv_blocks=32, max_model_len=128)
    assert llm.llm_engine.eos_token_ids >= {0, 300}
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=10, logit_bias={300: 100}))[0].outputs[0]
    assert out.token_ids == [300] and out.finish_reason == "stop"
    kept = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, logit_bias={300: 100}, ignore_eos=True))
    assert kept[0].outputs[0].token_ids == [300, 300, 300]


def test_the_default_sampler_lets_plain_greedy_rows_skip_the_logits_and_a_subclass_must_say_so():
    """argmax_suffices: greedy rows with nothing that reads or changes their logits; a subclass that masks
    (``constrain``) or samples its own way keeps the logits unless it says otherwise."""
    default = sampler.DefaultSampler()
    plain = SamplingParams(temperature=0)
    assert default.argmax_suffices(["a", "b"], [plain, plain])
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=1),
                  SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0, presence_penalty=1),
                  SamplingParams(temperature=0, frequency_penalty=1), SamplingParams(temperature=0, logit_bias={3: 1.0}),
                  SamplingParams(temperature=0, min_tokens=2)):
        assert not default.argmax_suffices(["a", "b"], [plain, other]), other

    class Masking(sampler.DefaultSampler):
        def constrain(self, logits, batch):
            return logits

    assert not Masking().argmax_suffices(["a"], [plain])
