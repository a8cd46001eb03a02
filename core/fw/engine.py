"""The engine: requests in, one scheduled batch per step, outputs back."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from fw import plugins
from fw.config import FwConfig
from fw.executor import Executor
from fw.interfaces.sampler import SamplingBatch
from fw.kv_cache import KVCacheManager
from fw.outputs import CompletionOutput, RequestOutput
from fw.platform import detect
from fw.request import Request
from fw.sampling_params import SamplingParams
from fw.scheduler import ScheduledBatch, Scheduler
from fw.tokenizer import Tokenizer
from fw.validate import check_model

log = logging.getLogger("fw")


class EngineError(ValueError):
    """A request or configuration the engine cannot serve; the message says why."""


@dataclass
class StepStats:
    """Passed to the ``fw_step_stats`` hook once per step."""

    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_preempted: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    step_seconds: float


class LLMEngine:
    def __init__(self, config: FwConfig) -> None:
        self.config = config
        device = detect(config.model.device)
        plugins.configure(config)
        model = check_model(config, device)
        result, hf_config = model.result, model.hf_config
        if not result.ok:
            raise EngineError(result.report())
        self.hook = plugins.get_plugin_manager().hook
        self.tokenizer = model.quant.load_tokenizer(config.model.model) or Tokenizer.from_dir(
            config.model.tokenizer or config.model.model, hf_config.get("eos_token_id")
        )
        self.max_model_len = config.model.max_model_len or hf_config.get("max_position_embeddings") or 2048
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
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = result.selected["sampler"].load()(result.options.get("sampler"))
        self.selected = {kind: spec.name for kind, spec in result.selected.items()}
        self.generators: dict[str, torch.Generator] = {}
        self.logits_processors: dict[str, list] = {}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        log.info(
            "fw engine: %s; KV cache %d blocks x %d = %d tokens",
            ", ".join(f"{k}={v}" for k, v in self.selected.items()),
            self.kv.pool.num_blocks, block_size, self.kv.pool.num_blocks * block_size,
        )
        self.hook.fw_engine_started(engine=self)

    # --- requests -----------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        params = params or SamplingParams()
        if params.n != 1:
            raise EngineError("n > 1 is not supported by this engine yet; send n separate requests")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise EngineError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise EngineError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "nothing would be left to generate"
            )
        vocab = self.executor.runner.hf_config.vocab_size
        if max(token_ids) >= vocab or min(token_ids) < 0:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id or str(next(self._ids))
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id, token_ids, params, self.tokenizer.eos_token_id, self.max_model_len, priority, text
        )
        if params.seed is not None:
            self.generators[request_id] = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = request
        processors = self.hook.fw_logits_processors(request_id=request_id, sampling_params=params)
        if any(processors):
            self.logits_processors[request_id] = [p for group in processors for p in group or []]
        self.scheduler.add(request)
        self.hook.fw_request_added(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self._finish(request) if request is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # --- the loop -----------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        inputs = self.scheduler.step_inputs(batch)
        logits = self.executor.execute(inputs)
        tokens, logprobs = self._sample(batch, inputs.sample_rows, logits)
        finished = set(self.scheduler.update(batch, inputs, tokens, logprobs))
        self._report(batch, time.perf_counter() - start)
        return [self._finish(r) if r in finished else self._output(r) for r in batch.requests]

    def _sample(self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        if not rows:
            return [], []
        requests = [batch.requests[i] for i in rows]
        for row, request in enumerate(requests):
            for processor in self.logits_processors.get(request.request_id, ()):
                logits[row] = processor(request.output_token_ids, logits[row])
        params = [r.params for r in requests]
        sampling = SamplingBatch(
            params=params,
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
            all_greedy=all(p.greedy for p in params),
            generators=[self.generators.get(r.request_id) for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
        )
        out = self.sampler.sample(logits, sampling)
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        return out.token_ids.tolist(), logprobs

    def _report(self, batch: ScheduledBatch, seconds: float) -> None:
        self.hook.fw_step_stats(
            stats=StepStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_scheduled_tokens=batch.num_tokens,
                num_preempted=len(batch.preempted),
                kv_cache_usage=self.kv.usage(),
                prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate(),
                step_seconds=seconds,
            )
        )

    def _output(self, request: Request) -> RequestOutput:
        logprob = sum(request.output_logprobs) if request.output_logprobs else None
        completion = CompletionOutput(
            0,
            self.tokenizer.decode(request.output_token_ids),
            list(request.output_token_ids),
            logprob,
            request.finish_reason,
        )
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, [completion], request.finished
        )

    def _finish(self, request: Request) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        self.generators.pop(request.request_id, None)
        self.logits_processors.pop(request.request_id, None)
        output = self._output(request)
        self.hook.fw_request_finished(request_id=request.request_id, output=output)
        return output

    def shutdown(self) -> None:
        self.executor.shutdown()
        plugins.unconfigure(self.config)


