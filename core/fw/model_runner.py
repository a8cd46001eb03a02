"""Loads the model with the selected plugins, owns the KV cache, runs one step's forward pass.

Every tensor-parallel rank runs one ModelRunner; each re-resolves its plugins
by name, so nothing but plain configuration crosses process boundaries.
"""

from __future__ import annotations

import torch

from fw import model_registry
from fw.config import FwConfig
from fw.forward_context import set_forward_context
from fw.interfaces.attention import AttentionBatch
from fw.model_loader import iter_safetensors, load_model, resolve_dtype
from fw.models.base import HFConfig, ModelContext
from fw.scheduler import StepInputs
from fw.validate import CheckResult

DEFAULT_CPU_KV_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: FwConfig, check: CheckResult, hf_config: dict, device: str) -> None:
        self.config = config
        self.device = device
        selected, options = check.selected, check.options
        quant = selected["quant"].load()(options.get("quant"), hf_config.get("quantization_config"))
        attention = selected["attention"].load()(options.get("attention"))
        self.attention = attention
        self.hf_config = HFConfig(hf_config)
        dtype_name = check.requirements.dtype
        self.dtype = resolve_dtype(self.hf_config, dtype_name)
        ctx = ModelContext(dtype=self.dtype, quant=quant, attention=attention)
        model_cls = model_registry.resolve(hf_config).load()
        tensors = quant.load_checkpoint(config.model.model) or iter_safetensors(config.model.model)
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
        self.num_blocks = self._num_blocks()
        self.kv_caches = [
            torch.empty(spec.shape(self.num_blocks), dtype=spec.dtype, device=device) for spec in self.kv_cache_specs
        ]

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

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step; returns float32 logits at ``inputs.logit_positions``, [len(logit_positions), vocab]."""
        for src, dst in inputs.copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        batch = AttentionBatch.build(inputs.block_tables, inputs.num_computed, inputs.num_new, self.block_size, self.device)
        positions = torch.cat(
            [torch.arange(c, c + n) for c, n in zip(inputs.num_computed, inputs.num_new, strict=True)]
        ).to(self.device)
        input_ids = torch.tensor(inputs.token_ids, dtype=torch.long, device=self.device)
        with set_forward_context(self.attention.prepare(batch), self.kv_caches):
            hidden = self.model(input_ids, positions)
        rows = torch.tensor(inputs.logit_positions, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        if logits.dtype != torch.float32:  # widening here would hide ties that rounding already made
            raise TypeError(f"{type(self.model).__name__}.compute_logits returned {logits.dtype}; logits must be float32")
        return logits
