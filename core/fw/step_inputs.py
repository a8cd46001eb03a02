"""The plain-data contract between the scheduler and the model workers: what one step computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepInputs:
    """What every model worker needs for one step; plain data, so it can be sent to TP ranks."""

    token_ids: list[int]  # the new tokens of every scheduled request, concatenated
    num_computed: list[int]  # per request: tokens already in the KV cache
    num_new: list[int]  # per request: tokens computed this step
    block_tables: list[list[int]]
    sample_rows: list[int]  # requests whose last new token ends their known tokens: they sample
    # Token positions whose logits come back: each sampling request's last token (and, with speculative decoding,
    # each of its draft tokens after it), then the prompt tokens of requests that asked for prompt logprobs.
    logit_positions: list[int]
    copies: list[tuple[int, int]]  # copy-on-write block copies to run before the forward
    kv_connector_meta: Any = None  # the KV connector's transfers for this step (build_connector_meta)
    # The positions pooling requests pool (fw.pooling), in order: the runner keeps the step's final hidden states
    # (ModelRunner.hidden_states) when there are any.
    hidden_positions: list[int] = field(default_factory=list)
    keep_hidden_states: bool = False  # a proposer reads every position's final hidden states (runner.hidden_states)
    # Every logits row only serves its argmax: greedy rows that nothing else reads (LLMEngine._argmax_only). The
    # runner may then return each row's token, int64 [rows], instead of the logits (ModelBase.greedy_tokens).
    argmax_only: bool = False
