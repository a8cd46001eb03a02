from __future__ import annotations

import torch

from fw.interfaces.sampler import Sampler, SamplerOutput, SamplingBatch
from fw.sdk.sampling_params import GREEDY_EPS


def typical_filter(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Mask every token outside the smallest set, ordered by |surprise - entropy|, holding ``mass``."""
    logp = logits.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    order = distance.argsort(dim=-1)
    p_sorted = p.gather(-1, order)
    drop_sorted = (p_sorted.cumsum(dim=-1) - p_sorted) >= mass
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class TypicalSampler(Sampler):
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        greedy = logits.argmax(dim=-1)
        temperature = batch.temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)
        probs = typical_filter(logits / temperature, self.options.mass).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        tokens = torch.where(batch.temperature < GREEDY_EPS, greedy, (probs / noise).argmax(dim=-1))
        return SamplerOutput(token_ids=tokens)
