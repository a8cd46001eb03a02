"""Beam search over an engine: every round asks for the top 2k next tokens of each live beam.

Each round submits one single-token request per live beam (prompt + beam so far) with ``logprobs=2 * beam_width``:
the sampler's own logprobs rank the candidates, and prefix caching makes the shared prefixes nearly free. Asking
for 2k candidates per beam is enough: at most k of a beam's candidates can make the global top k, and at most k of
them can be end-of-sequence tokens, so k live beams always survive.

It needs a sampler that declares the "beam" feature (``sampler="beam"``): one whose logprobs are the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fw.engine.client import EngineError, SyncEngineClient
from fw.engine.input_processor import prompt_token_ids
from fw.inputs import PromptType, parse_prompts
from fw.outputs import BeamSearchOutput, BeamSearchSequence
from fw.sdk.sampling_params import BeamSearchParams, SamplingParams

# prefixes (prompt + beam tokens) -> for each, {token id: logprob} of its best candidates
NextTokens = Callable[[list[list[int]], int], list[dict[int, float]]]


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finished: bool = False

    def score(self, length_penalty: float) -> float:
        return self.logprob / max(len(self.tokens), 1) ** length_penalty


def search(
    prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_id: int | None, next_tokens: NextTokens
) -> list[list[Beam]]:
    """For each prompt, its ``beam_width`` best hypotheses, best first."""
    k = params.beam_width
    live = [[Beam()] for _ in prompts]
    done: list[list[Beam]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        order = [(p, beam) for p, beams in enumerate(live) for beam in beams]
        if not order:
            break
        candidates_per_beam = next_tokens([list(prompts[p]) + b.tokens for p, b in order], 2 * k)
        grouped: list[list[Beam]] = [[] for _ in prompts]
        for (p, beam), candidates in zip(order, candidates_per_beam, strict=True):
            for token, logprob in candidates.items():
                ends = token == eos_token_id and not params.ignore_eos
                grouped[p].append(Beam(beam.tokens + [token], beam.logprob + logprob, ends))
        for p, cands in enumerate(grouped):
            # Stable sort: ties keep the earlier beam / higher-ranked candidate, as a brute force would.
            cands.sort(key=lambda b: -b.logprob)
            live[p] = []
            for cand in cands:
                if cand.finished:
                    done[p].append(cand)
                elif len(live[p]) < k:
                    live[p].append(cand)
                if len(live[p]) == k:
                    break
            if params.early_stopping and len(done[p]) >= k:
                live[p] = []
    return [sorted(d + alive, key=lambda b: -b.score(params.length_penalty))[:k] for d, alive in zip(done, live, strict=True)]


def beam_search(
    engine: SyncEngineClient, prompts: Sequence[PromptType], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Each prompt's ``beam_width`` best continuations, run on ``engine`` through add/step/abort only."""
    view = engine.view
    if "beam" not in view.sampler_features:
        raise EngineError(
            f"beam search needs a sampler with the 'beam' feature (e.g. sampler='beam'); "
            f"the selected sampler is {view.selected['sampler']!r}"
        )

    def next_tokens(prefixes: list[list[int]], n: int) -> list[dict[int, float]]:
        probe = SamplingParams(temperature=0.0, max_tokens=1, logprobs=n, ignore_eos=True)
        ids: list[str] = []
        outputs = {}
        try:
            ids.extend(engine.add_request(prefix, probe) for prefix in prefixes)
            while engine.has_unfinished_requests():
                outputs.update({o.request_id: o for o in engine.step() if o.finished})
        except BaseException:
            for request_id in ids:  # a failed round fails the search, leaving nothing queued
                engine.abort_request(request_id)
            raise
        return [{t: lp.logprob for t, lp in outputs[i].outputs[0].logprobs[0].items()} for i in ids]

    token_ids = [prompt_token_ids(p, view.tokenizer) for p in parse_prompts(prompts)]
    results = search(token_ids, params, view.tokenizer.eos_token_id, next_tokens)
    return [
        BeamSearchOutput([
            BeamSearchSequence(
                beam.tokens, view.tokenizer.decode(beam.tokens), beam.logprob, beam.score(params.length_penalty),
                "stop" if beam.finished else "length",
            )
            for beam in beams
        ])
        for beams in results
    ]
