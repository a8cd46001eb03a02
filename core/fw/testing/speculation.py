"""Greedy token-exactness checks for speculative decoding (the core's tests and each proposer plugin's): mixed
requests, an engine stepped by hand and the preemptions it counted, and the comparison of outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fw.sdk.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fw.llm import LLM

# Text that repeats itself, so that lookups find drafts (a tiny random model's greedy output loops, too).
TEXTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "def f(x):\n    return x + 1\n\ndef f(x):\n    return",
    "1 2 3 4 5 1 2 3 4 5 1 2 3",
    "Hello",
    "a b a b a b a b a b a b a b a b a b a b a b",
]


def mixed_requests(n: int) -> tuple[list[str], list[SamplingParams]]:
    """n greedy requests of varied lengths and parameters: penalties and min_tokens see the drafts as output."""
    variants = [
        {},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"min_tokens": 20, "max_tokens": 24},
        {"logprobs": 2, "max_tokens": 17},
        {"max_tokens": 5},
    ]
    prompts = [TEXTS[i % len(TEXTS)] * (1 + i % 3) for i in range(n)]
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": 40, **variants[i % len(variants)]}) for i in range(n)]
    return prompts, params


def run_all(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[list, list[int]]:
    """Every request's output, stepping the engine by hand; the preemptions the engine counted."""
    engine = llm.llm_engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i].outputs[0] for i in ids], engine.stats().num_preemptions


def assert_same(outputs, reference) -> None:
    """Token for token, finish reason and logprobs (within float rounding) the same."""
    for got, want in zip(outputs, reference, strict=True):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        if want.logprobs is not None:
            assert len(got.logprobs) == len(want.logprobs)
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in w)


# Batches of 1, 8 and 32 mixed requests: chunked prefill at 8, preemption mid-run (a small cache) at 32.
GREEDY_CASES = [
    (1, {}),
    (8, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 0}),
    (32, {"num_kv_blocks": 16, "max_model_len": 128}),
]


def check_greedy_exact(model: str, speculative_config: dict, batch: int, settings: dict) -> LLM:
    """``batch`` mixed greedy requests give the same outputs with ``speculative_config`` as without it (and, with a
    small cache, a preemption happened); the speculative engine, for further checks."""
    from fw.llm import LLM

    prompts, params = mixed_requests(batch)
    args = {"num_kv_blocks": 256, "max_model_len": 256, "dtype": "float32", **settings}
    reference, _ = run_all(LLM(model, **args), prompts, params)
    # Drafts at every batch size (on a CPU the default stops them above 4 running requests).
    llm = LLM(model, speculative_config={"disable_by_batch_size": 1 << 16, **speculative_config}, **args)
    outputs, preempted = run_all(llm, prompts, params)
    assert_same(outputs, reference)
    if "num_kv_blocks" in settings:
        assert preempted > 0, "the cache was large enough: no preemption happened"
    return llm
