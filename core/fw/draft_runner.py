"""The second model a speculative-decoding proposer drafts with (``fw.interfaces.draft_runner``): a ModelRunner of
another checkpoint, or of the target checkpoint's multi-token-prediction head, with a KV cache of its own.

It is built from the engine's configuration with the checkpoint swapped (same device, dtype choice, attention
backend rules and block size; no KV connector, no speculation of its own) and runs on rank 0 only: its weights are
whole there, so tensor and pipeline parallelism are refused for it. Its cache is sized by the same rule as the
target's (``--num-kv-blocks``, ``--kv-cache-memory``, or the device default), in blocks of the draft's own layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from fw.config import FwConfig, picklable
from fw.interfaces.draft_runner import DraftOutput, DraftRunner, DraftSequence
from fw.kv_cache import KVCacheManager
from fw.model_runner import ModelRunner
from fw.step_inputs import StepInputs
from fw.validate import check_model


def _config_for(config: FwConfig, model_path: str) -> FwConfig:
    data = picklable(config)
    data["model"]["model"] = model_path
    data["kv_connector"] = None
    data["speculative_config"] = None
    return type(config).model_validate(data)


class ModelDraftRunner(DraftRunner):
    def __init__(self, config: FwConfig, model_path: str, device: str, mtp: bool) -> None:
        parallel = config.parallel
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            raise ValueError("a draft model runs on one device: not with --tensor-parallel-size or "
                             "--pipeline-parallel-size above 1")
        draft_config = _config_for(config, model_path)
        checked = check_model(draft_config)
        if not checked.result.ok:
            raise ValueError(f"draft model {model_path}: {checked.result.report()}")
        model_cls = checked.result.selected["models"].load()
        if mtp:
            head = getattr(model_cls, "mtp_head", None)
            if head is None:
                raise ValueError(f"{model_cls.__name__} has no multi-token-prediction head in fw")
            model_cls = head()
        self.hf_config = checked.hf_config
        self.runner = ModelRunner(draft_config, checked.result, checked.hf_config, device, model_cls=model_cls)
        self.kv = KVCacheManager(self.runner.num_blocks, draft_config.cache.block_size, enable_prefix_caching=False)
        self.slots: dict[str, int] = {}  # request -> positions with a slot

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        if num_tokens <= self.slots.get(request_id, 0):
            return True
        if not self.kv.allocate_slots(request_id, num_tokens):
            return False
        self.slots[request_id] = num_tokens
        return True

    def run(self, sequences: list[DraftSequence], hidden_states: torch.Tensor | None = None) -> DraftOutput:
        for seq in sequences:
            if not self.reserve(seq.request_id, seq.start + len(seq.token_ids)):
                raise RuntimeError(f"the draft model's KV cache has no room for {seq.request_id}: reserve() first")
        num_new = [len(seq.token_ids) for seq in sequences]
        inputs = StepInputs(
            token_ids=[t for seq in sequences for t in seq.token_ids],
            num_computed=[seq.start for seq in sequences],
            num_new=num_new,
            block_tables=[self.kv.block_ids(seq.request_id) for seq in sequences],
            sample_rows=list(range(len(sequences))),
            logit_positions=[end - 1 for end in itertools.accumulate(num_new)],
            copies=[],
            keep_hidden_states=hidden_states is not None,
        )
        if hidden_states is not None:  # a head that reads them takes them from here (DeepseekMTP)
            self.runner.model.previous_hidden = hidden_states
        logits = self.runner.execute(inputs)
        states = self.runner.hidden_states
        return DraftOutput(logits, states[inputs.logit_positions] if states is not None else None)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        if self.slots.get(request_id, 0) > num_tokens:
            self.kv.trim(request_id, num_tokens)
            self.slots[request_id] = num_tokens

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.slots.pop(request_id, None)


def loader(config: FwConfig, device: str) -> Callable[..., DraftRunner]:
    """``ProposerContext.load_draft``: ``load_draft(model_path, mtp=False)`` builds a draft runner."""

    def load_draft(model_path: str, mtp: bool = False) -> DraftRunner:
        return ModelDraftRunner(config, model_path, device, mtp)

    return load_draft
