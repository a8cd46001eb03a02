"""The engine core: requests in, one step at a time (schedule -> execute -> sample -> update), outputs back.

Input processing (``InputProcessor``) turns prompts into Requests before they are queued; output processing
(``OutputProcessor``) turns the step's results into RequestOutputs. The core owns the scheduler, KV cache, executor
and sampler; its callers see it through ``SyncEngineClient`` (fw.engine.client) and hooks through ``EngineView``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

import torch

from fw import distributed, draft_runner, plugins
from fw.config import FwConfig
from fw.engine.client import DecodeGraphStats, EngineError, EngineStats
from fw.engine.input_processor import InputProcessor, eos_token_ids, sequence_ids
from fw.engine.output_processor import OutputProcessor
from fw.engine.spec_decode import SpecDecoder
from fw.executor import Executor
from fw.inputs import PromptType
from fw.interfaces.hooks import EngineView, StepStats
from fw.interfaces.sampler import RequestError, Sampler, SamplingBatch
from fw.interfaces.spec_proposer import ProposerContext
from fw.kv_cache import KVCacheManager
from fw.outputs import RequestOutput
from fw.platform import detect
from fw.pooling import PoolerConfig, PoolingParams, dimensions_problem, pool_step
from fw.request import Request
from fw.scheduler import ScheduledBatch, Scheduler
from fw.sdk import native
from fw.sdk.sampler import with_logprobs
from fw.sdk.sampling_params import SamplingParams
from fw.sdk.tokenizer import Tokenizer
from fw.step_inputs import StepInputs
from fw.validate import check_model

log = logging.getLogger("fw")


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
        eos_ids = eos_token_ids(config.model.model, hf_config)
        self.tokenizer = model.format.tokenizer(config.model.model) or Tokenizer.from_dir(
            config.model.tokenizer or config.model.model, eos_ids[0] if eos_ids else None
        )
        # Every id that ends a sequence (instruct models often have several: end-of-text and end-of-turn).
        self.eos_token_ids = frozenset(eos_ids) | ({self.tokenizer.eos_token_id} - {None})
        torch.manual_seed(config.model.seed)
        self.executor = Executor(config, result, hf_config, device.device)
        try:
            self.max_model_len = self._max_model_len(config, hf_config)
        except EngineError:
            self.executor.shutdown()
            raise
        block_size = config.cache.block_size
        self.kv = KVCacheManager(self.executor.num_blocks, block_size, config.cache.enable_prefix_caching)
        self.sampler = plugins.build("sampler", result)
        self.scheduler = Scheduler(
            config, self.kv, self.sampler.is_ready, plugins.build("kv_connector.scheduler", result, block_size),
            device.device, self.max_model_len,
        )
        self.selected = {kind: spec.name for kind, spec in result.selected.items()}
        vocab_size = self.executor.runner.hf_config.vocab_size
        self.spec = self._spec_decoder(result, hf_config, vocab_size, device.device) if config.speculative_config else None
        self.pooler = PoolerConfig.resolve(config.model.pooling, config.model.model)
        self.pooling_refusal = self._pooling_refusal()
        self.view = EngineView(
            config, self.tokenizer, vocab_size, self.max_model_len, MappingProxyType(dict(self.selected)),
            frozenset(result.selected["sampler"].capabilities.features),
            ("generate",) if self.pooling_refusal else ("generate", "embed"),
        )
        self.inputs = InputProcessor(self.tokenizer, self.eos_token_ids, vocab_size, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self.generators: dict[str, torch.Generator] = {}
        self.logits_processors: dict[str, list] = {}
        # Parallel sampling (n > 1): the client's request id -> its n sequences, which run as requests.
        self.groups: dict[str, list[Request]] = {}
        # Called before every forward pass: a lockstep replica (fw.engine.lockstep) opens its round there.
        self.before_forward: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._stats = EngineStats()
        log.info(
            "fw engine: %s; KV cache (%s) %d blocks x %d = %d tokens",
            ", ".join(f"{k}={v}" for k, v in self.selected.items()), config.cache.kv_cache_dtype,
            self.kv.pool.num_blocks, block_size, self.kv.pool.num_blocks * block_size,
        )
        self._publish_stats()
        self.hook.fw_engine_started(engine=self.view)

    def _max_model_len(self, config: FwConfig, hf_config: dict) -> int:
        """The context length: --max-model-len, else the model's lowered to what the KV cache holds (as vLLM's
        ``--max-model-len auto``: a model's 32k or 128k context should not stop a small cache from serving it)."""
        held = self.executor.num_blocks * config.cache.block_size
        length = config.model.max_model_len
        if length is None:
            length = hf_config.get("max_position_embeddings") or 2048
            if 0 < held < length:
                log.warning("max_model_len %d (the model's) lowered to %d, what the KV cache holds; raise "
                            "--kv-cache-memory for a longer context", length, held)
                length = held
        if held < length:
            raise EngineError(f"the KV cache holds {held} tokens, less than one sequence of max_model_len {length}; "
                              "raise --kv-cache-memory or lower --max-model-len")
        budget = config.scheduler.max_num_batched_tokens
        if not config.scheduler.enable_chunked_prefill and budget is not None and budget < length:
            raise EngineError(
                f"--max-num-batched-tokens {budget} is below max_model_len {length}: without chunked "
                "prefill a prompt is computed in one step, so a longer one could never run; raise it, lower "
                "--max-model-len, or leave --enable-chunked-prefill on"
            )
        return length

    def _spec_decoder(self, result, hf_config: dict, vocab_size: int, device: str) -> SpecDecoder:
        """The proposer ``speculative_config`` names, built; what cannot run with it is refused by name."""
        config, runner = self.config, self.executor.runner
        problems = []
        if type(self.sampler).probabilities is Sampler.probabilities:
            problems.append(f"sampler {self.selected['sampler']!r} does not give its probabilities, which verifying "
                            "drafts needs (Sampler.probabilities)")
        context = ProposerContext(
            config.speculative_config.num_speculative_tokens, vocab_size, self.max_model_len, device, runner.dtype,
            hf_config, config, runner.model, draft_runner.loader(config, device),
        )
        try:
            proposer = plugins.build("spec_proposers", result, context)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            k = proposer.num_speculative_tokens
            if not 1 <= k < self.scheduler.token_budget:
                problems.append(f"speculative_config.num_speculative_tokens {k}: a step verifies 1 + k tokens of a "
                                f"request, so k must be from 1 to {self.scheduler.token_budget - 1} (the step's token "
                                "budget, --max-num-batched-tokens, less one)")
            if proposer.needs_hidden_states and config.parallel.pipeline_parallel_size > 1:
                problems.append(f"spec proposer {self.selected['spec_proposers']!r} reads the target's hidden states, "
                                "which only the last pipeline stage has: not with --pipeline-parallel-size > 1")
        if problems:
            self.executor.shutdown()
            raise EngineError("speculative decoding: " + "; ".join(problems))
        return SpecDecoder(config.speculative_config, proposer, vocab_size, self.max_model_len, torch.device(device).type)

    def _pooling_refusal(self) -> str | None:
        """Why this engine cannot pool (None when it can)."""
        model_cls = type(self.executor.runner.model)
        if not model_cls.supports_pooling:
            return f"the model class {model_cls.__name__} does not give the hidden states pooling needs"
        if self.config.parallel.pipeline_parallel_size > 1:
            return "pooling does not run under pipeline parallelism (-pp)"
        return None

    # --- requests -----------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; ``params.n`` sequences are sampled for it, or with PoolingParams its prompt is pooled
        (fw.pooling). Returns its id."""
        if priority and not self.scheduler.by_priority:
            raise EngineError(f"priority {priority} needs the priority scheduling policy (scheduling_policy=priority)")
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(prompt, params, request_id, priority)
        params = params or SamplingParams()
        if params.structured_outputs is not None and "structured" not in self.view.sampler_features:
            raise EngineError(
                f"structured output needs a sampler with the 'structured' feature (e.g. --sampler outlines); "
                f"the selected sampler is {self.selected['sampler']!r}"
            )
        if self.spec is not None:
            self.spec.check_request(params)
        prompt, token_ids = self.inputs.token_ids(prompt, params)
        masks = self.inputs.token_masks(params)
        request_id = self._free_id(request_id, params.n)
        sequences = self.inputs.sequences(request_id, prompt, token_ids, params, priority)
        for i, seq in enumerate(sequences):
            try:
                self.sampler.add_request(seq.request_id, seq.params, self.tokenizer)
            except ValueError as exc:
                for added in sequences[:i]:
                    self._forget(added)
                raise EngineError(str(exc)) from None
            if seq.params.seed is not None:
                self.generators[seq.request_id] = torch.Generator().manual_seed(seq.params.seed)
            hooked = self.hook.fw_logits_processors(
                request_id=seq.request_id, sampling_params=seq.params, engine=self.view
            )
            processors = masks + [p for group in hooked for p in group or []]
            if processors:
                self.logits_processors[seq.request_id] = processors
        self.groups[request_id] = sequences
        for seq in sequences:
            self.scheduler.add(seq)
        self.hook.fw_request_added(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params, engine=self.view
        )
        self._publish_stats()
        return request_id

    def _add_pooling_request(self, prompt: PromptType, params: PoolingParams, request_id: str | None,
                             priority: int) -> str:
        """One sequence that samples nothing: no sampler state, logits processors or request hooks."""
        if self.pooling_refusal:
            raise EngineError(f"this model cannot pool (embeddings): {self.pooling_refusal}")
        runner = self.executor.runner
        if problem := dimensions_problem(params.dimensions, runner.hf_config, runner.hf_config.hidden_size):
            raise EngineError(problem)
        prompt, token_ids = self.inputs.token_ids(prompt, params)
        request_id = self._free_id(request_id, 1)
        request = self.inputs.pooling_request(request_id, prompt, token_ids, self.pooler, params, priority)
        self.groups[request_id] = [request]
        self.scheduler.add(request)
        self._publish_stats()
        return request_id

    def _free_id(self, request_id: str | None, n: int) -> str:
        """The request's id (a fresh one if None), refused while in use."""
        request_id = request_id or str(next(self._ids))
        if request_id in self.groups or self.scheduler.id_in_use(request_id, sequence_ids(request_id, n)):
            raise EngineError(f"request id {request_id!r} is already in use")
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its sequences) and free its KV blocks now."""
        if request_id not in self.groups:
            return None
        for seq in self.groups[request_id]:
            if not seq.finished:
                self.scheduler.abort(seq.request_id)
                self._forget(seq)
        output = self._group_output(request_id)
        self._publish_stats()
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def has_live_work(self) -> bool:
        """Whether a step has anything to do: requests, or KV transfers only the worker's reports complete."""
        return bool(self.groups) or self.scheduler.kv_pending

    def last_admitted(self) -> set[str]:
        """The requests the latest step admitted: the suspects when a step fails without naming a request."""
        return {seq.group_id for seq in self.scheduler.last_admitted}

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (or admission, or abort): safe to read from any thread."""
        return self._stats

    @property
    def runs_workers(self) -> bool:
        """Whether worker processes (tensor or pipeline parallelism) run that only ``shutdown()`` stops."""
        return self.executor.comm_cls is not None

    # --- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            self._publish_stats()

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.kv_pending:  # nothing to compute, but the connector's transfers need the worker
                self._execute(self.scheduler.step_inputs(batch))
                self.scheduler.finish_transfers(self.executor.runner.kv_report)
            if self.scheduler.waiting or self.scheduler.kv_pending:  # waiting on preparation or transfers: don't spin
                time.sleep(0.002)
            return []
        inputs = self.scheduler.step_inputs(batch)
        inputs.argmax_only = self._argmax_only(batch, inputs)
        if self.spec is not None:
            for seq in batch.preempted:
                self.spec.forget(seq.request_id)
            inputs.keep_hidden_states = self.spec.proposer.needs_hidden_states
        # Kernels built on first use run inside the forward pass: time them apart, so forward_seconds is the model's.
        built, forward_start = native.build_seconds(), time.perf_counter()
        logits = self._execute(inputs)
        compile_seconds = native.build_seconds() - built
        forward_seconds = time.perf_counter() - forward_start - compile_seconds
        if self.scheduler.finish_transfers(self.executor.runner.kv_report):
            # Loads failed: those requests went back to the queue to compute their tokens, and this step's
            # results are dropped for all (nothing was sampled or accounted yet); the next step runs the rest again.
            return []
        # A sampling request's logits rows: its last token's, and one per draft token (speculative decoding).
        num_sampled = sum(1 + len(batch.requests[i].draft_token_ids) for i in inputs.sample_rows)
        self.outputs.record_prompt_logprobs(batch, inputs, logits[num_sampled:])
        tokens, logprobs = self._sample(batch, inputs.sample_rows, logits[:num_sampled])
        # Before update(): it advances each request past this step's tokens and drops their drafts.
        decodes = sum(
            n for r, c, n in zip(batch.requests, inputs.num_computed, inputs.num_new, strict=True)
            if n == 1 + len(r.draft_token_ids) and c >= len(r.prompt_token_ids)
        )
        if inputs.keep_hidden_states:
            self.spec.keep_hidden(batch, inputs, tokens, self.executor.runner.hidden_states)
        if inputs.hidden_positions:
            pool_step(batch.requests, inputs, self.executor.runner.hidden_states)
        for seq in self.scheduler.update(batch, inputs, tokens, logprobs):
            del seq.output_logprobs[len(seq.output_token_ids) :]  # entries of tokens a stop left unappended
            self._forget(seq)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
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
            engine=self.view,
        )
        return [self._group_output(group) for group in dict.fromkeys(r.group_id for r in batch.requests)]

    def _execute(self, inputs: StepInputs) -> torch.Tensor:
        if self.before_forward is not None:
            self.before_forward()
        return self.executor.execute(inputs)

    def _argmax_only(self, batch: ScheduledBatch, inputs: StepInputs) -> bool:
        """Whether the step's logits serve only each sampled row's argmax: no drafts, no prompt logprobs, no logits
        processors, and the sampler says its rows take the argmax of the raw logits and read nothing else."""
        if self.spec is not None or len(inputs.logit_positions) != len(inputs.sample_rows) or not inputs.sample_rows:
            return False
        requests = [batch.requests[i] for i in inputs.sample_rows]
        if any(self.logits_processors.get(r.request_id) for r in requests):
            return False
        return self.sampler.argmax_suffices([r.request_id for r in requests], [r.params for r in requests])

    def _sample(
        self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Each sampling request's new tokens (one, or its accepted drafts and one more) and their logprobs.
        ``logits`` may be the tokens themselves (int64, ``StepInputs.argmax_only``): the sampler has nothing to do."""
        if not rows:
            return [], None
        if logits.dtype == torch.int64:
            return [[t] for t in logits.tolist()], None
        requests = [batch.requests[i] for i in rows]
        # A request with drafts has a row per position (its last token's, then each draft's), each seeing the output
        # as it is there: the drafts before it count, so that penalties, min_tokens and processors stay exact.
        owners = [r for r in requests for _ in range(1 + len(r.draft_token_ids))]
        outputs = [r.output_token_ids + r.draft_token_ids[:j] for r in requests for j in range(1 + len(r.draft_token_ids))]
        # A failure pinned on requests raises RequestError naming them, before any state changes: the caller
        # fails those and steps again without them (AsyncEngine does).
        errors: dict[str, Exception] = {}
        for row, (request, output) in enumerate(zip(owners, outputs, strict=True)):
            try:
                for processor in self.logits_processors.get(request.request_id, ()):
                    logits[row] = processor(output, logits[row])
            except Exception as exc:  # noqa: BLE001 - the request's own processor: it alone fails
                errors[request.group_id] = exc
        if errors:
            raise RequestError(errors)
        if len(owners) == len(requests):  # no drafts to verify: one token each, as the sampler draws it
            out = self._call_sampler(self.sampler.sample, logits, owners, outputs)
            kept = [[t] for t in out.token_ids.tolist()]
        else:
            probs = self._call_sampler(self.sampler.probabilities, logits, owners, outputs)
            kept = self.spec.verify(requests, probs, [self.generators.get(r.request_id) for r in requests])
            starts = itertools.accumulate((1 + len(r.draft_token_ids) for r in requests), initial=0)
            positions = [start + t for start, tokens in zip(starts, kept, strict=False) for t in range(len(tokens))]
            owners = [owners[i] for i in positions]
            flat = torch.tensor([t for tokens in kept for t in tokens])
            out = with_logprobs(logits[positions], flat, [r.params for r in owners])
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        self.outputs.record_sample_logprobs(owners, out.token_ids.tolist(), out, logprobs)
        if logprobs is None:
            return kept, None
        ends = list(itertools.accumulate(len(tokens) for tokens in kept))
        return kept, [logprobs[end - len(tokens) : end] for end, tokens in zip(ends, kept, strict=True)]

    def _call_sampler(self, method: Callable, logits: torch.Tensor, owners: list[Request], outputs: list[list[int]]):
        """``method`` (the sampler's ``sample`` or ``probabilities``) on the rows; a failure is pinned on the
        requests whose rows fail."""
        try:
            return method(logits, self._sampling_batch(owners, outputs))
        except RequestError as exc:  # the sampler names sequences: fail their requests
            groups = {r.request_id: r.group_id for r in owners}
            raise RequestError({groups.get(seq, seq): error for seq, error in exc.errors.items()}) from None
        except Exception as exc:
            if culprits := self._failing_rows(method, owners, outputs, logits):
                raise RequestError(culprits) from exc
            raise

    def _sampling_batch(self, requests: list[Request], outputs: list[list[int]]) -> SamplingBatch:
        params = [r.params for r in requests]
        return SamplingBatch(
            request_ids=[r.request_id for r in requests],
            params=params,
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
            all_greedy=all(p.greedy for p in params),
            generators=[self.generators.get(r.request_id) for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=outputs,
            eos_token_id=self.tokenizer.eos_token_id,
        )

    def _failing_rows(
        self, method: Callable, requests: list[Request], outputs: list[list[int]], logits: torch.Tensor
    ) -> dict[str, Exception]:
        """The requests whose rows fail on their own: a failed batch is pinned on them alone."""
        errors: dict[str, Exception] = {}
        for row, (request, output) in enumerate(zip(requests, outputs, strict=True)):
            try:
                method(logits[row : row + 1].clone(), self._sampling_batch([request], [output]))
            except Exception as exc:  # noqa: BLE001 - collected, raised as one RequestError
                errors[request.group_id] = exc
        return errors

    def _group_output(self, request_id: str) -> RequestOutput:
        output = self.outputs.request_output(request_id, self.groups[request_id])
        if output.finished:
            del self.groups[request_id]
            if isinstance(output, RequestOutput):  # a generation request's: pooling ones reach no request hooks
                self.hook.fw_request_finished(request_id=request_id, output=output, engine=self.view)
        return output

    def _forget(self, seq: Request) -> None:
        """Drop a finished sequence's per-request state everywhere."""
        self.generators.pop(seq.request_id, None)
        self.logits_processors.pop(seq.request_id, None)
        if seq.pooling is None:  # a pooling request never reached the sampler
            self.sampler.remove_request(seq.request_id)
        if self.spec is not None:
            self.spec.forget(seq.request_id)

    def _publish_stats(self) -> None:
        """Replace the stats snapshot (one reference: a reader on another thread sees the old or the new one)."""
        transfers = self.scheduler.transfers
        graphs = self.executor.runner.graphs
        self._stats = EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_connector=replace(transfers.stats) if transfers.connector is not None else None,
            spec_decode=replace(self.spec.stats) if self.spec is not None else None,
            decode_graphs=None if graphs is None else DecodeGraphStats(dict(graphs.replayed), dict(graphs.untraced),
                                                                       graphs.off),
        )

    def shutdown(self) -> None:
        if self.executor.runner.kv_connector is not None:
            self.executor.runner.kv_connector.shutdown()
        self.executor.shutdown()
        plugins.unconfigure(self.config)
