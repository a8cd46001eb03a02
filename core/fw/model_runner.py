"""Loads the model with the selected plugins, owns the KV cache, runs one step's forward pass.

Every tensor-parallel rank runs one ModelRunner; each re-resolves its plugins
by name, so nothing but plain configuration crosses process boundaries.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch

from fw import distributed, plugins
from fw.config import FwConfig
from fw.decode_graph import DecodeGraphs
from fw.forward_context import set_forward_context
from fw.interfaces.attention import AttentionBatch
from fw.interfaces.comm import Pending
from fw.interfaces.kvconnector import KVTransferReport
from fw.model_loader import load_model, resolve_dtype
from fw.models.base import HFConfig, ModelContext
from fw.sdk import kernels
from fw.step_inputs import StepInputs
from fw.validate import CheckResult

DEFAULT_CPU_KV_BYTES = 1 << 30


def micro_batches(num_new: list[int], stages: int) -> list[slice]:
    """The step's requests as contiguous runs of about equal token counts, one per pipeline stage but at most one
    per request; concatenated, they are the step's rows in order."""
    count, total = min(stages, len(num_new)), sum(num_new)
    # Each request's middle token: a run ends after the requests whose middle comes before its share of the tokens.
    middles = [end - n / 2 for end, n in zip(itertools.accumulate(num_new), num_new, strict=True)]
    bounds = [0]
    for k in range(1, count):  # leaving a request for each later run
        end = bisect.bisect_right(middles, k * total / count)
        bounds.append(min(max(end, bounds[-1] + 1), len(num_new) - (count - k)))
    bounds.append(len(num_new))
    return [slice(start, end) for start, end in itertools.pairwise(bounds)]


class ModelRunner:
    def __init__(
        self, config: FwConfig, check: CheckResult, hf_config: dict, device: str, model_cls: type | None = None
    ) -> None:
        """``model_cls``: another model than the checkpoint architecture's (its multi-token-prediction head)."""
        self.config = config
        self.device = device
        quant = plugins.build("quant", check, hf_config.get("quantization_config"))
        attention = plugins.build("attention", check)
        self.attention = attention
        self.hf_config = HFConfig(hf_config)
        dtype_name = check.requirements.dtype
        self.dtype = resolve_dtype(self.hf_config, dtype_name)
        ctx = ModelContext(dtype=self.dtype, quant=quant, attention=attention)
        model_cls = model_cls or check.selected["models"].load()
        tensors = plugins.build("checkpoint_format", check).weights(config.model.model)
        with kernels.choosing("loading the model"):
            self.model = load_model(
                model_cls, self.hf_config, ctx, tensors, device=device, kv_cache_dtype=config.cache.kv_cache_dtype
            )
        self.block_size = config.cache.block_size
        # The backend lays out each layer's cache; the runner only sizes and allocates what it declares.
        self.kv_cache_specs = [
            attention.kv_cache_spec(s, self.block_size, self.dtype, config.cache.kv_cache_dtype)
            for s in self.model.attention_specs()
        ]
        self.bytes_per_block = sum(spec.bytes_per_block for spec in self.kv_cache_specs)
        # Every rank allocates the same block ids the scheduler hands out: the smallest rank's count.
        self.num_blocks = distributed.min_over_ranks(self._num_blocks())
        # Zeroed, not empty: writing every page now (about 0.2 s a GiB on a CPU) keeps first-touch page faults out
        # of the prompts' prefill, where they cost a 128-token prompt about 6 ms (store_kv, 24 layers).
        self.kv_caches = [
            torch.zeros(spec.shape(self.num_blocks), dtype=spec.dtype, device=device) for spec in self.kv_cache_specs
        ]
        # A pipeline stage holds a contiguous run of layers, whose attention finds its cache by layer number.
        self.layer_caches = [None] * self.model.attention_specs()[0].layer_idx + self.kv_caches
        self.kv_connector = plugins.build("kv_connector.worker", check)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        self.kv_report = KVTransferReport()  # the connector's report of the latest step
        # The latest step's final hidden states, every position in the step's order, when the step asked to keep
        # them (``StepInputs.keep_hidden_states``: an MTP or EAGLE proposer drafts from them).
        self.hidden_states: torch.Tensor | None = None
        single = distributed.get_tp_group().world_size == distributed.get_pp_group().world_size == 1
        graphs = (device == "cpu" and single and self.kv_connector is None and not config.model.enforce_eager
                  and getattr(self.model, "decode_graphs", False))
        self.graphs = DecodeGraphs(self) if graphs else None

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory is not None:
            budget = int(cache.kv_cache_memory)
        elif self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = int(free - total * (1 - cache.gpu_memory_utilization))
        else:
            budget = DEFAULT_CPU_KV_BYTES
        return max(budget // self.bytes_per_block, 0)

    def _finish_kv_transfers(self) -> None:
        self.kv_connector.wait_for_save()
        self.kv_report = self.kv_connector.get_finished()

    @torch.inference_mode()
    @kernels.choosing("serving")  # the attention backend's choices, on the first step
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step; returns float32 logits at ``inputs.logit_positions``, [len(logit_positions), vocab], or
        with ``inputs.argmax_only`` each row's token, int64 [len(logit_positions)], where the model gives them."""
        if kernels.refresh() and self.graphs is not None:  # native kernels built in the background landed
            self.graphs.reset()
        for src, dst in inputs.copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(inputs.kv_connector_meta)
        if not inputs.num_new:  # a step that only moves KV: asynchronous loads or sends in flight
            self._finish_kv_transfers()
            return torch.empty(0, self.hf_config.vocab_size, dtype=torch.float32, device=self.device)
        # Under pipeline parallelism the step runs as micro-batches: a stage sends one on (without waiting) and
        # starts the next while the following stage works on it.
        parts = [self._step_tensors(inputs, part)
                 for part in micro_batches(inputs.num_new, distributed.get_pp_group().world_size)]
        keep_hidden = inputs.keep_hidden_states or bool(inputs.hidden_positions)  # a proposer's, or pooling's
        # Steps whose every token is sampled: decodes, and decodes verifying speculative drafts.
        graphable = inputs.logit_positions == list(range(sum(inputs.num_new))) and not keep_hidden
        if self.graphs is not None and graphable:
            hidden = self.graphs.hidden(*parts[0])  # the only part: graphs run without pipeline parallelism
            if hidden is not None:
                return self._logits([hidden], inputs.logit_positions, False, inputs.argmax_only)
        sends: list[Pending] = []
        hidden = [self._forward(*part, inputs.kv_connector_meta, sends) for part in parts]
        for send in sends:
            send.wait()
        if connector is not None:
            self._finish_kv_transfers()
        return self._logits(hidden, inputs.logit_positions, keep_hidden, inputs.argmax_only)

    def _step_tensors(self, inputs: StepInputs, part: slice) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor]:
        """The attention batch, token ids and positions of the requests ``part`` of the step, a batch of their
        own."""
        num_computed, num_new = inputs.num_computed[part], inputs.num_new[part]
        batch = AttentionBatch.build(inputs.block_tables[part], num_computed, num_new, self.block_size, self.device)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(num_computed, num_new, strict=True)])
        first = sum(inputs.num_new[: part.start])
        token_ids = inputs.token_ids[first : first + sum(num_new)]
        return batch, torch.tensor(token_ids, dtype=torch.long, device=self.device), positions.to(self.device)

    def _forward(self, batch: AttentionBatch, input_ids: torch.Tensor, positions: torch.Tensor, connector_meta: Any,
                 sends: list[Pending]) -> torch.Tensor:
        """The model on one micro-batch of the step; adds the sends it left in flight to ``sends``."""
        metadata = self.attention.prepare(batch)
        with set_forward_context(metadata, self.layer_caches, self.kv_connector, connector_meta) as ctx:
            hidden = self.model(input_ids, positions)
        sends.extend(ctx.sends)
        return hidden

    def _logits(self, hidden: list[torch.Tensor], logit_positions: list[int], keep_hidden: bool,
                argmax_only: bool) -> torch.Tensor:
        """The last pipeline stage computes the logits, from its micro-batches' hidden states in the step's row
        order, and sends them to the first, whose rank 0 samples; a stage in between returns none (an empty
        tensor). ``argmax_only`` in one stage: each row's token (int64), where the model gives it."""
        pp = distributed.get_pp_group()
        last = pp.world_size - 1
        if pp.rank < last:
            out = torch.empty(len(logit_positions) if pp.rank == 0 else 0, self.hf_config.vocab_size,
                              dtype=torch.float32, device=self.device)
            return pp.recv(out, last) if pp.rank == 0 else out
        rows = torch.tensor(logit_positions, dtype=torch.long, device=self.device)
        states = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        self.hidden_states = states if keep_hidden else None
        if argmax_only and not last:
            tokens = self.model.greedy_tokens(states[rows])
            if tokens is not None:
                return tokens
        logits = self.model.compute_logits(states[rows])
        if logits.dtype != torch.float32:  # widening here would hide ties that rounding already made
            raise TypeError(f"{type(self.model).__name__}.compute_logits returned {logits.dtype}; logits must be float32")
        if last:
            pp.send(logits, 0)
        return logits
