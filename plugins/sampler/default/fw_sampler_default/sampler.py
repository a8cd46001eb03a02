from __future__ import annotations

import torch

from fw.interfaces.sampler import Sampler, SamplerOutput, SamplingBatch
from fw.sampling_params import GREEDY_EPS


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus; k <= 0 and p == 1 leave a row untouched."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches p: drop a token when the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


class DefaultSampler(Sampler):
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logprobs_all = logits.log_softmax(dim=-1)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            temperature = batch.temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)
            top_k = torch.tensor([p.top_k for p in batch.params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in batch.params], device=logits.device, dtype=logits.dtype)
            probs = _apply_top_k_top_p(logits / temperature, top_k, top_p).softmax(dim=-1)
            # Gumbel-max in exponential form: argmax(p / E) with E ~ Exp(1) samples from p. Seeded rows draw
            # their noise from their own generator, so their tokens don't depend on the rest of the batch.
            noise = torch.empty_like(probs).exponential_()
            for row, gen in enumerate(batch.generators):
                if gen is not None:
                    noise[row].exponential_(generator=gen)
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(batch.temperature < GREEDY_EPS, greedy_tokens, sampled)
        chosen = logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return SamplerOutput(token_ids=tokens, logprobs=chosen)
