"""The default sampler: vLLM's SamplingParams, vectorised over the batch (the ``default`` and ``beam`` sampler
plugins' implementation, and the base of samplers that add constraints: ``outlines``).

Order, as vLLM applies it: log-probabilities are taken from the raw logits;
then penalties (repetition, frequency, presence), logit_bias, min_tokens
(no EOS/stop tokens yet), ``constrain`` (a subclass's hook: structured
output masks), then temperature, top-k, top-p and min-p, and a draw.
"""

from __future__ import annotations

import torch

from fw.interfaces.sampler import Sampler, SamplerOutput, SamplingBatch
from fw.sdk import native_ops
from fw.sdk.sampling_params import GREEDY_EPS, SamplingParams


def _row_tensor(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _token_mask(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] counts of each token per row, built with one scatter."""
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    width = max((len(r) for r in rows), default=0)
    if width:
        # Pad with the extra column `vocab`, dropped below.
        ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], device=device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt and output tokens, divides positive / multiplies negative logits), frequency
    (minus count x penalty) and presence (minus penalty once) penalties, as vLLM defines them."""
    params = batch.params
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if all(r == 1.0 for r in rep) and not any(freq) and not any(pres):
        return logits
    vocab = logits.shape[-1]
    out_counts = _token_mask(batch.output_token_ids, vocab, logits.device)
    if any(r != 1.0 for r in rep):
        seen = (out_counts > 0) | (_token_mask(batch.prompt_token_ids, vocab, logits.device) > 0)
        penalty = _row_tensor(rep, logits).unsqueeze(-1).expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    logits = logits - _row_tensor(freq, logits).unsqueeze(-1) * out_counts
    return logits - _row_tensor(pres, logits).unsqueeze(-1) * (out_counts > 0)


def apply_logit_bias_and_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    rows, cols, values = [], [], []
    banned_rows, banned_cols = [], []
    vocab = logits.shape[-1]
    for i, p in enumerate(batch.params):
        for token, bias in (p.logit_bias or {}).items():
            if 0 <= token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(bias)
        if len(batch.output_token_ids[i]) < p.min_tokens:
            stops = set(p.stop_token_ids)
            if batch.eos_token_id is not None and not p.ignore_eos:
                stops.add(batch.eos_token_id)
            banned_rows += [i] * len(stops)
            banned_cols += sorted(stops)
    if rows:
        logits = logits.index_put((torch.tensor(rows), torch.tensor(cols)), _row_tensor(values, logits), accumulate=True)
    if banned_rows:
        logits = logits.index_put(
            (torch.tensor(banned_rows), torch.tensor(banned_cols)), torch.tensor(float("-inf"), dtype=logits.dtype)
        )
    return logits


# Truncation sorts the largest logits only: a row's top-k, or this many for a nucleus (top-p) or min-p set without
# one; a row whose set reaches past them is sorted whole. A trained model's nucleus at p = 0.9 is tens to hundreds of
# tokens. At 32 rows of a 152k vocabulary the full sort took 190 ms a step, topk(1024) 9 ms, topk(20) 2 ms.
CANDIDATES = 1024


def _truncate_sorted(values: torch.Tensor, log_norm: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's largest logits ``values`` (sorted, descending) truncation drops: top-k's rank, top-p's
    mass (probabilities ``exp(values - log_norm)``: the mass before a token already reaches p) and min-p's ratio
    to the largest. The first always stays."""
    ranks = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    drop = (top_k > 0).unsqueeze(-1) & (ranks >= top_k.unsqueeze(-1))
    probs = (values - log_norm).exp().masked_fill(drop, 0.0)
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
    drop |= probs < min_p.unsqueeze(-1) * probs[:, :1]
    drop[:, 0] = False
    return drop


def _log_normalizers(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(logits / temperature).logsumexp(dim=-1, keepdim=True)``: in one native pass a row on the CPU."""
    if native_ops.logit_rows(logits):
        return torch.ops.fw_layers.log_normalizers(logits, temperature.float()).unsqueeze(-1)
    return (logits / temperature.unsqueeze(-1)).logsumexp(dim=-1, keepdim=True)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits / temperature`` (default 1) with the logits outside each row's top-k, nucleus and min-p set masked;
    k <= 0, p == 1, min_p == 0 leave a row alone. The probabilities top-p adds up are those within the top-k, if
    any, else over the whole vocabulary. Only the candidates are divided (a positive temperature keeps the order)."""
    rows, vocab = logits.shape
    scale = (torch.ones(rows, device=logits.device) if temperature is None else temperature).unsqueeze(-1)
    top_k = torch.where(top_k >= vocab, 0, top_k)
    truncated = (top_k > 0) | (top_p < 1) | (min_p > 0)
    with_k = top_k > 0
    width = min(vocab, int(top_k.max()) if bool(with_k.all()) else max(CANDIDATES, int(top_k.max())))
    values, order = logits.topk(width, dim=-1)
    values = values / scale
    kept = values.masked_fill(with_k.unsqueeze(-1) & (torch.arange(width, device=logits.device) >= top_k.unsqueeze(-1)),
                              -torch.inf)
    # Top-p's probabilities: within the top-k, else over the whole vocabulary (a pass over it, where a row asks);
    # min-p alone compares with the largest, for which the largest logit serves.
    log_norm = torch.where(with_k.unsqueeze(-1), kept.logsumexp(dim=-1, keepdim=True), values[:, :1])
    whole = (~with_k & (top_p < 1)).unsqueeze(-1)
    if bool(whole.any()):
        log_norm = torch.where(whole, _log_normalizers(logits, scale.squeeze(-1)), log_norm)
    drop = _truncate_sorted(values, log_norm, top_k, top_p, min_p)
    # A row is settled where its set ends among the candidates: top-k's always, the others' where they dropped the
    # last candidate (or had every token).
    settled = with_k | drop[:, -1] | (width == vocab)
    out = torch.full_like(logits, -torch.inf).scatter_(-1, order, values.masked_fill(drop, -torch.inf))
    if not bool(truncated.all()):  # rows that ask for none, in a batch where others do
        out[~truncated] = logits[~truncated] / scale[~truncated]
    unsettled = truncated & ~settled
    if bool(unsettled.any()):
        scaled = logits[unsettled] / scale[unsettled]
        sorted_logits, full_order = scaled.sort(dim=-1, descending=True)
        full_drop = _truncate_sorted(sorted_logits, scaled.logsumexp(dim=-1, keepdim=True), top_k[unsettled],
                                     top_p[unsettled], min_p[unsettled])
        out[unsettled] = scaled.scatter(-1, full_order, sorted_logits.masked_fill(full_drop, -torch.inf))
    return out


def draw(logits: torch.Tensor, temperature: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """A token per row from ``softmax(logits / temperature)``: the first whose cumulative probability passes
    ``u`` for a uniform ``u`` per row. Seeded rows draw theirs from their own generator, so their tokens don't
    depend on the batch. On the CPU one native pass over each row (fw_layers.sample_rows), where the torch ops cost
    45 ms a step at 32 rows of a 152k vocabulary; elsewhere, and for a row holding a NaN, the same rule in torch ops.
    """
    uniforms = torch.rand(len(generators), dtype=torch.float64)
    for row, gen in enumerate(generators):
        if gen is not None:
            uniforms[row] = torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64).item()
    if native_ops.logit_rows(logits):
        tokens = torch.ops.fw_layers.sample_rows(logits, temperature.float(), uniforms)
        if not bool((tokens < 0).any()):
            return tokens
    probs = (logits / temperature.unsqueeze(-1)).softmax(dim=-1).double()
    cumulative = probs.cumsum(dim=-1)
    target = (uniforms.to(probs.device) * cumulative[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    # Rounding can leave the target unpassed: then the last token with any probability.
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(tokens, last)


def with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list) -> SamplerOutput:
    """``tokens`` with what the rows that asked for logprobs report: log-probabilities of the raw logits, as vLLM
    gives them, ranks, and the top-N (the full matrix only when some row asks for top-N)."""
    out = SamplerOutput(token_ids=tokens)
    if all(p.logprobs is None for p in params):
        return out  # a logsumexp over the vocabulary per row saved (7 ms a step at 32 x 152k)
    log_norm = raw.logsumexp(dim=-1, keepdim=True)
    chosen_logits = raw.gather(-1, tokens.unsqueeze(-1))
    out.logprobs = (chosen_logits - log_norm).squeeze(-1)
    out.ranks = (raw > chosen_logits).sum(dim=-1) + 1
    top_n = max((p.logprobs or 0 for p in params), default=0)
    if top_n:
        top_logits, out.top_token_ids = raw.topk(top_n, dim=-1)
        out.top_logprobs = top_logits - log_norm
    return out


def plain_greedy(params: list[SamplingParams]) -> bool:
    """Greedy rows whose token is the argmax of their raw logits: no logprobs, penalties, logit bias or min_tokens."""
    return all(p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.frequency_penalty
               and not p.presence_penalty and not p.logit_bias and not p.min_tokens for p in params)


class DefaultSampler(Sampler):
    def constrain(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Subclasses mask tokens here (structured output); runs before temperature and truncation."""
        return logits

    def argmax_suffices(self, request_ids: list[str], params: list[SamplingParams]) -> bool:
        """``plain_greedy`` rows, where ``constrain`` and ``sample`` are these: a subclass that changes either says
        for itself (the outlines sampler does), else its rows keep the logits."""
        own = type(self).constrain is DefaultSampler.constrain and type(self).sample is DefaultSampler.sample
        return own and plain_greedy(params)

    def _shaped(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits the argmax and the temperature see: penalties, logit bias, min_tokens, ``constrain``."""
        logits = apply_penalties(logits, batch)
        logits = apply_logit_bias_and_min_tokens(logits, batch)
        return self.constrain(logits, batch)

    def _truncated(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, then top-k, top-p and min-p: the logits and the temperature per row whose softmax a draw
        samples (greedy rows' are meaningless). Rows that ask for no truncation leave the scaling to the draw, which
        saves a pass over the vocabulary; truncation scales what it keeps."""
        params = batch.params
        temperature = batch.temperature.clamp(min=GREEDY_EPS)
        if not any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            return logits, temperature
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = _row_tensor([p.top_p for p in params], logits)
        min_p = _row_tensor([p.min_p for p in params], logits)
        return apply_top_k_top_p_min_p(logits, top_k, top_p, min_p, temperature), torch.ones_like(temperature)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits
        logits = self._shaped(logits, batch)
        greedy_tokens = native_ops.argmax(logits)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            shaped, temperature = self._truncated(logits, batch)
            tokens = torch.where(batch.temperature < GREEDY_EPS, greedy_tokens, draw(shaped, temperature, batch.generators))
        return with_logprobs(raw, tokens, batch.params)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = self._shaped(logits, batch)
        greedy = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if batch.all_greedy:
            return greedy
        shaped, temperature = self._truncated(logits, batch)
        probs = (shaped / temperature.unsqueeze(-1)).softmax(dim=-1)
        return torch.where((batch.temperature < GREEDY_EPS).unsqueeze(-1), greedy, probs)
