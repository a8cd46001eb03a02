"""The engine: requests in, one scheduled batch per step, outputs back."""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from fw import distributed, native, plugins
from fw.config import FwConfig
from fw.detokenizer import IncrementalDetokenizer
from fw.executor import Executor
from fw.hookspecs import StepStats
from fw.inputs import PromptType, TextPrompt, TokensPrompt, parse_prompt
from fw.interfaces.sampler import RequestError, SamplingBatch
from fw.kv_cache import KVCacheManager
from fw.logits_processors import LogitsProcessor, allow_only, bad_words_token_ids, ban_sequences
from fw.outputs import CompletionOutput, Logprob, RequestOutput
from fw.platform import detect
from fw.request import Request, new_metrics
from fw.sampling_params import SamplingParams
from fw.scheduler import ScheduledBatch, Scheduler
from fw.tokenizer import Tokenizer
from fw.validate import check_model

log = logging.getLogger("fw")


class EngineError(ValueError):
    """A request or configuration the engine cannot serve; the message says why."""


def _eos_token_ids(model_path: str, hf_config: dict) -> list[int]:
    """End-of-sequence ids from config.json and, where present, generation_config.json (an int or a list)."""
    sources = [hf_config.get("eos_token_id")]
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids: list[int] = []
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


class LLMEngine:
    def __init__(self, config: FwConfig) -> None:
        self.config = config
        device = detect(config.model.device)
        plugins.configure(config)
        model = check_model(config, device)
        result, hf_config = model.result, model.hf_config
        if not result.ok:
            raise EngineError(result.report())
        # A replica of an expert-parallel front joined the replicas' world (fw.data_parallel); no other engine did.
        if config.parallel.data_parallel_size not in (1, distributed.get_group("dp").world_size):
            raise EngineError(
                f"--data-parallel-size {config.parallel.data_parallel_size}: an engine is one replica; "
                "fw serve runs several (fw.data_parallel)"
            )
        self.hook = plugins.get_plugin_manager().hook
        eos_ids = _eos_token_ids(config.model.model, hf_config)
        self.tokenizer = model.quant.load_tokenizer(config.model.model) or Tokenizer.from_dir(
            config.model.tokenizer or config.model.model, eos_ids[0] if eos_ids else None
        )
        # Every id that ends a sequence (instruct models often have several: end-of-text and end-of-turn).
        self.eos_token_ids = frozenset(eos_ids) | ({self.tokenizer.eos_token_id} - {None})
        self.max_model_len = config.model.max_model_len or hf_config.get("max_position_embeddings") or 2048
        budget = config.scheduler.max_num_batched_tokens
        if not config.scheduler.enable_chunked_prefill and budget is not None and budget < self.max_model_len:
            raise EngineError(
                f"--max-num-batched-tokens {budget} is below max_model_len {self.max_model_len}: without chunked "
                "prefill a prompt is computed in one step, so a longer one could never run; raise it, lower "
                "--max-model-len, or leave --enable-chunked-prefill on"
            )
        torch.manual_seed(config.model.seed)
        self.executor = Executor(config, result, hf_config, device.device)
        block_size = config.cache.block_size
        min_blocks = -(-self.max_model_len // block_size)
        if self.executor.num_blocks < min_blocks:
            self.executor.shutdown()
            raise EngineError(
                f"the KV cache holds {self.executor.num_blocks * block_size} tokens, less than one sequence of "
                f"max_model_len {self.max_model_len}; raise --kv-cache-memory or lower --max-model-len"
            )
        self.kv = KVCacheManager(self.executor.num_blocks, block_size, config.cache.enable_prefix_caching)
        self.sampler = result.selected["sampler"].load()(result.options.get("sampler"))
        self.sampler_features = result.selected["sampler"].capabilities.features
        connector = result.selected.get("kv_connector")
        self.scheduler = Scheduler(
            config, self.kv, self.sampler.is_ready,
            connector.load().scheduler(result.options.get("kv_connector"), block_size) if connector else None,
            device.device, self.max_model_len,
        )
        self.selected = {kind: spec.name for kind, spec in result.selected.items()}
        self.generators: dict[str, torch.Generator] = {}
        self.logits_processors: dict[str, list] = {}
        # Parallel sampling (n > 1): the client's request id -> its n sequences, which run as requests.
        self.groups: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self._steps = itertools.count()
        log.info(
            "fw engine: %s; KV cache (%s) %d blocks x %d = %d tokens",
            ", ".join(f"{k}={v}" for k, v in self.selected.items()), config.cache.kv_cache_dtype,
            self.kv.pool.num_blocks, block_size, self.kv.pool.num_blocks * block_size,
        )
        self.hook.fw_engine_started(engine=self)

    # --- requests -----------------------------------------------------------

    def prompt_token_ids(self, prompt: TextPrompt | TokensPrompt) -> list[int]:
        """A parsed prompt's token ids: its own, or its text's."""
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return self.tokenizer.encode(prompt["prompt"])

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; ``params.n`` sequences are sampled for it. Returns its id."""
        params = params or SamplingParams()
        if params.structured_outputs is not None and "structured" not in self.sampler_features:
            raise EngineError(
                f"structured output needs a sampler with the 'structured' feature (e.g. --sampler outlines); "
                f"the selected sampler is {self.selected['sampler']!r}"
            )
        if priority and not self.scheduler.by_priority:
            raise EngineError(f"priority {priority} needs the priority scheduling policy (scheduling_policy=priority)")
        prompt = parse_prompt(prompt)
        token_ids = self.prompt_token_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        self._validate_prompt(token_ids, params)
        masks = self._token_masks(params)
        request_id = request_id or str(next(self._ids))
        # A finished request's blocks may still be held for the KV connector's send, under its sequence ids.
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        held = self.scheduler.held
        if request_id in self.groups or request_id in held.values() or any(s in held for s in seq_ids):
            raise EngineError(f"request id {request_id!r} is already in use")
        salt = prompt.get("cache_salt")
        metrics = new_metrics()
        sequences = []
        for i in range(params.n):
            # Each sequence of a seeded request gets its own reproducible stream (seed + i, kept within 64 bits).
            seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
            seq_params = replace(params, n=1, seed=seed)
            seq_id = seq_ids[i]
            try:
                self.sampler.add_request(seq_id, seq_params, self.tokenizer)
            except ValueError as exc:
                for seq in sequences:
                    self._forget(seq)
                raise EngineError(str(exc)) from None
            detok = IncrementalDetokenizer(
                self.tokenizer, token_ids, seq_params.skip_special_tokens, seq_params.stop,
                seq_params.include_stop_str_in_output,
            ) if seq_params.detokenize else None
            seq = Request(
                seq_id, token_ids, seq_params, self.eos_token_ids, self.max_model_len, priority, prompt.get("prompt"),
                detok, group_id=request_id, cache_keys=(salt,) if salt else (), metrics=metrics,
            )
            if seq_params.seed is not None:
                self.generators[seq_id] = torch.Generator().manual_seed(seq_params.seed)
            hooked = self.hook.fw_logits_processors(request_id=seq_id, sampling_params=seq_params, engine=self)
            processors = masks + [p for group in hooked for p in group or []]
            if processors:
                self.logits_processors[seq_id] = processors
            sequences.append(seq)
        self.groups[request_id] = sequences
        for seq in sequences:
            self.scheduler.add(seq)
        self.hook.fw_request_added(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params, engine=self
        )
        return request_id

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (its logits' width): every token id a request names must be below it."""
        return self.executor.runner.hf_config.vocab_size

    def _token_masks(self, params: SamplingParams) -> list[LogitsProcessor]:
        """Logits processors for allowed_token_ids and bad_words. Every token id and top_k is checked against the
        vocabulary first: a value out of range would fail the step that the other requests share."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise EngineError(f"top_k: at most the vocabulary size {vocab} (0 or -1: no limit), got {params.top_k}")
        bad = bad_words_token_ids(self.tokenizer, params.bad_words)
        for name, ids in (("allowed_token_ids", params.allowed_token_ids or []), ("bad_words", sum(bad, [])),
                          ("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            outside = sorted({t for t in ids if t >= vocab})
            if outside:
                raise EngineError(f"{name}: token ids {outside[:8]} are outside the model's vocabulary [0, {vocab})")
        masks = [allow_only(params.allowed_token_ids)] if params.allowed_token_ids is not None else []
        return masks + ([ban_sequences(bad)] if bad else [])

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise EngineError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise EngineError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "nothing would be left to generate"
            )
        vocab = self.vocab_size
        if max(token_ids) >= vocab or min(token_ids) < 0:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its sequences) and free its KV blocks now."""
        if request_id not in self.groups:
            return None
        for seq in self.groups[request_id]:
            if not seq.finished:
                self.scheduler.abort(seq.request_id)
                self._forget(seq)
        return self._group_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # --- the loop -----------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.kv_pending:  # nothing to compute, but the connector's transfers need the worker
                self.executor.execute(self.scheduler.step_inputs(batch))
                self.scheduler.finish_transfers(self.executor.runner.kv_report)
            if self.scheduler.waiting or self.scheduler.kv_pending:  # waiting on preparation or transfers: don't spin
                time.sleep(0.002)
            return []
        inputs = self.scheduler.step_inputs(batch)
        # Kernels built on first use run inside the forward pass: time them apart, so forward_seconds is the model's.
        built, forward_start = native.build_seconds(), time.perf_counter()
        logits = self.executor.execute(inputs)
        compile_seconds = native.build_seconds() - built
        forward_seconds = time.perf_counter() - forward_start - compile_seconds
        if self.scheduler.connector is not None and self.scheduler.finish_transfers(self.executor.runner.kv_report):
            # Loads failed: those requests went back to the queue to compute their tokens, and this step's
            # results are dropped for all (nothing was sampled or accounted yet); the next step runs the rest again.
            return []
        self._record_prompt_logprobs(batch, inputs, logits[len(inputs.sample_rows) :])
        tokens, logprobs = self._sample(batch, inputs.sample_rows, logits[: len(inputs.sample_rows)])
        # Before update(): it advances each request past this step's tokens.
        decodes = sum(
            n == 1 and c >= len(r.prompt_token_ids)
            for r, c, n in zip(batch.requests, inputs.num_computed, inputs.num_new, strict=True)
        )
        for seq in self.scheduler.update(batch, inputs, tokens, logprobs):
            self._forget(seq)
        self.hook.fw_step_stats(
            stats=StepStats(
                step=next(self._steps),
                num_prefill_tokens=batch.num_tokens - decodes,
                num_decode_tokens=decodes,
                num_scheduled=len(batch.requests),
                num_preempted=len(batch.preempted),
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_cache_usage=self.kv.usage(),
                prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate(),
                forward_seconds=forward_seconds,
                compile_seconds=compile_seconds,
                step_seconds=time.perf_counter() - start,
            ),
            engine=self,
        )
        return [self._group_output(group) for group in dict.fromkeys(r.group_id for r in batch.requests)]

    def _sample(self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        if not rows:
            return [], []
        requests = [batch.requests[i] for i in rows]
        # A failure pinned on requests raises RequestError naming them, before any state changes: the caller
        # fails those and steps again without them (AsyncEngine does).
        errors: dict[str, Exception] = {}
        for row, request in enumerate(requests):
            try:
                for processor in self.logits_processors.get(request.request_id, ()):
                    logits[row] = processor(request.output_token_ids, logits[row])
            except Exception as exc:  # noqa: BLE001 - the request's own processor: it alone fails
                errors[request.group_id] = exc
        if errors:
            raise RequestError(errors)
        try:
            out = self.sampler.sample(logits, self._sampling_batch(requests))
        except RequestError as exc:  # the sampler names sequences: fail their requests
            groups = {r.request_id: r.group_id for r in requests}
            raise RequestError({groups.get(seq, seq): error for seq, error in exc.errors.items()}) from None
        except Exception as exc:
            if culprits := self._failing_rows(requests, logits):
                raise RequestError(culprits) from exc
            raise
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        for row, request in enumerate(requests):
            if request.params.logprobs is not None and logprobs is not None:
                entry = {tokens[row]: self._logprob(request, tokens[row], logprobs[row],
                                                    int(out.ranks[row]) if out.ranks is not None else None)}
                if out.top_token_ids is not None:
                    ids = out.top_token_ids[row, : request.params.logprobs].tolist()
                    vals = out.top_logprobs[row, : request.params.logprobs].tolist()
                    for rank, (tok, val) in enumerate(zip(ids, vals, strict=True), start=1):
                        entry.setdefault(tok, self._logprob(request, tok, val, rank))
                request.output_logprobs.append(entry)
        return tokens, logprobs

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        params = [r.params for r in requests]
        return SamplingBatch(
            request_ids=[r.request_id for r in requests],
            params=params,
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
            all_greedy=all(p.greedy for p in params),
            generators=[self.generators.get(r.request_id) for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            eos_token_id=self.tokenizer.eos_token_id,
        )

    def _failing_rows(self, requests: list[Request], logits: torch.Tensor) -> dict[str, Exception]:
        """The requests whose rows fail to sample on their own: a failed batch is pinned on them alone."""
        errors: dict[str, Exception] = {}
        for row, request in enumerate(requests):
            try:
                self.sampler.sample(logits[row : row + 1].clone(), self._sampling_batch([request]))
            except Exception as exc:  # noqa: BLE001 - collected, raised as one RequestError
                errors[request.group_id] = exc
        return errors

    def _logprob(self, request: Request, token: int, logprob: float, rank: int | None) -> Logprob:
        text = self.tokenizer.decode([token], skip_special_tokens=False) if request.params.detokenize else None
        return Logprob(logprob, rank, text)

    def _record_prompt_logprobs(self, batch: ScheduledBatch, inputs, logits: torch.Tensor) -> None:
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

    def _group_output(self, request_id: str) -> RequestOutput:
        sequences = self.groups[request_id]
        first = sequences[0]
        finished = all(seq.finished for seq in sequences)
        output = RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(i, seq) for i, seq in enumerate(sequences)],
            finished=finished,
            first_token_time=min((s.first_token_time for s in sequences if s.first_token_time), default=None),
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            metrics=replace(first.metrics),  # a snapshot: the request's own copy changes as it runs
            num_cached_tokens=first.num_cached_tokens,
        )
        if finished:
            del self.groups[request_id]
            self.hook.fw_request_finished(request_id=request_id, output=output, engine=self)
        return output

    def _forget(self, seq: Request) -> None:
        """Drop a finished sequence's per-request state everywhere."""
        self.generators.pop(seq.request_id, None)
        self.logits_processors.pop(seq.request_id, None)
        self.sampler.remove_request(seq.request_id)

    def shutdown(self) -> None:
        if self.executor.runner.kv_connector is not None:
            self.executor.runner.kv_connector.shutdown()
        self.executor.shutdown()
        plugins.unconfigure(self.config)


