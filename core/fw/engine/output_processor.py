"""Output processing: sampled tokens' logprob entries, prompt logprobs, and the RequestOutputs callers receive.

Detokenization and stop strings run as each token is appended (``Request.append_token`` through its
``IncrementalDetokenizer``), since a stop string ends the sequence in the step that produced it; this module
turns that state into outputs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fw.interfaces.sampler import SamplerOutput
from fw.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from fw.request import Request
from fw.scheduler import ScheduledBatch
from fw.sdk.tokenizer import Tokenizer
from fw.step_inputs import StepInputs


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def record_sample_logprobs(self, requests: list[Request], tokens: list[int], out: SamplerOutput,
                               logprobs: list[float] | None) -> None:
        """Each request that asked for logprobs gets this position's entry: the sampled token and the top ones."""
        for row, request in enumerate(requests):
            if request.params.logprobs is None or logprobs is None:
                continue
            rank = int(out.ranks[row]) if out.ranks is not None else None
            entry = {tokens[row]: self._logprob(request, tokens[row], logprobs[row], rank)}
            if out.top_token_ids is not None:
                ids = out.top_token_ids[row, : request.params.logprobs].tolist()
                vals = out.top_logprobs[row, : request.params.logprobs].tolist()
                for top_rank, (tok, val) in enumerate(zip(ids, vals, strict=True), start=1):
                    entry.setdefault(tok, self._logprob(request, tok, val, top_rank))
            request.output_logprobs.append(entry)

    def record_prompt_logprobs(self, batch: ScheduledBatch, inputs: StepInputs, logits: torch.Tensor) -> None:
        """Logits at prompt position p score prompt token p + 1; the first prompt token gets None."""
        if not len(logits):
            return
        logprobs = logits.log_softmax(dim=-1)
        row = 0
        for request, start, n in zip(batch.requests, inputs.num_computed, inputs.num_new, strict=True):
            k = request.params.prompt_logprobs
            prompt_len = len(request.prompt_token_ids)
            if k is None or start >= prompt_len:
                continue
            if start == 0:
                request.prompt_logprobs = [None]
            del request.prompt_logprobs[start + 1 :]  # a step run again after a failure records its positions once
            for pos in range(start, min(start + n, prompt_len)):
                if pos + 1 < prompt_len:
                    lp = logprobs[row]
                    nxt = request.prompt_token_ids[pos + 1]
                    entry = {nxt: self._logprob(request, nxt, lp[nxt].item(), int((lp > lp[nxt]).sum()) + 1)}
                    if k:
                        vals, ids = lp.topk(k)
                        for rank, (tok, val) in enumerate(zip(ids.tolist(), vals.tolist(), strict=True), start=1):
                            entry.setdefault(tok, self._logprob(request, tok, val, rank))
                    request.prompt_logprobs.append(entry)
                row += 1

    def request_output(self, request_id: str, sequences: list[Request]) -> RequestOutput | PoolingRequestOutput:
        """A request's output so far: every sequence's, finished once all are; a pooling request's vector."""
        first = sequences[0]
        if first.pooling is not None:
            return PoolingRequestOutput(request_id, PoolingOutput(first.pooling.result), first.prompt_token_ids,
                                        first.finished, first.num_cached_tokens)
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(i, seq) for i, seq in enumerate(sequences)],
            finished=all(seq.finished for seq in sequences),
            first_token_time=min((s.first_token_time for s in sequences if s.first_token_time), default=None),
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            metrics=replace(first.metrics),  # a snapshot: the request's own copy changes as it runs
            num_cached_tokens=first.num_cached_tokens,
        )

    def _completion(self, index: int, seq: Request) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=seq.detokenizer.visible_text(seq.finished) if seq.detokenizer is not None else "",
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=seq.output_logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _logprob(self, request: Request, token: int, logprob: float, rank: int | None) -> Logprob:
        text = self.tokenizer.decode([token], skip_special_tokens=False) if request.params.detokenize else None
        return Logprob(logprob, rank, text)
