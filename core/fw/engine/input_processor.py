"""Input processing: a prompt and its params, checked against the model, become the Requests the scheduler runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fw.detokenizer import IncrementalDetokenizer
from fw.engine.client import EngineError
from fw.inputs import PromptType, TextPrompt, TokensPrompt, parse_prompt
from fw.logits_processors import LogitsProcessor, allow_only, bad_words_token_ids, ban_sequences
from fw.pooling import PoolerConfig, Pooling, PoolingParams
from fw.request import Request, new_metrics
from fw.sdk.sampling_params import SamplingParams
from fw.sdk.tokenizer import Tokenizer


def eos_token_ids(model_path: str, hf_config: dict) -> list[int]:
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


def prompt_token_ids(prompt: TextPrompt | TokensPrompt, tokenizer: Tokenizer) -> list[int]:
    """A parsed prompt's token ids: its own, or its text's."""
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    return tokenizer.encode(prompt["prompt"])


class InputProcessor:
    """Turns (prompt, params) into one Request per sequence (``params.n``), refusing what the model cannot serve
    before anything is queued: a bad value would otherwise fail the step that every other request shares."""

    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def token_ids(
        self, prompt: PromptType, params: SamplingParams | PoolingParams
    ) -> tuple[TextPrompt | TokensPrompt, list[int]]:
        """The parsed prompt and its token ids, truncated as ``params`` asks and checked against the model."""
        parsed = parse_prompt(prompt)
        token_ids = prompt_token_ids(parsed, self.tokenizer)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        self._validate_prompt(token_ids, params)
        return parsed, token_ids

    def sequences(
        self, request_id: str, prompt: TextPrompt | TokensPrompt, token_ids: list[int], params: SamplingParams,
        priority: int,
    ) -> list[Request]:
        """The request's sequences, with ids ``request_id`` (n = 1) or ``request_id#i``."""
        seq_ids = sequence_ids(request_id, params.n)
        salt = prompt.get("cache_salt")
        metrics = new_metrics()
        sequences = []
        for i, seq_id in enumerate(seq_ids):
            # Each sequence of a seeded request gets its own reproducible stream (seed + i, kept within 64 bits).
            seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
            seq_params = replace(params, n=1, seed=seed)
            detok = IncrementalDetokenizer(
                self.tokenizer, token_ids, seq_params.skip_special_tokens, seq_params.stop,
                seq_params.include_stop_str_in_output,
            ) if seq_params.detokenize else None
            sequences.append(Request(
                seq_id, token_ids, seq_params, self.eos_token_ids, self.max_model_len, priority, prompt.get("prompt"),
                detok, group_id=request_id, cache_keys=(salt,) if salt else (), metrics=metrics,
            ))
        return sequences

    def pooling_request(
        self, request_id: str, prompt: TextPrompt | TokensPrompt, token_ids: list[int], pooler: PoolerConfig,
        params: PoolingParams, priority: int,
    ) -> Request:
        """A pooling request's one sequence; its SamplingParams are neutral, as it samples nothing."""
        return Request(
            request_id, token_ids, SamplingParams(detokenize=False), self.eos_token_ids, self.max_model_len, priority,
            prompt.get("prompt"), group_id=request_id, cache_keys=(salt,) if (salt := prompt.get("cache_salt")) else (),
            pooling=Pooling.of(pooler, params),
        )

    def token_masks(self, params: SamplingParams) -> list[LogitsProcessor]:
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

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        if not token_ids:
            raise EngineError("the prompt is empty")
        # A pooled prompt may fill the context; a generating one must leave room for a token.
        generates = isinstance(params, SamplingParams)
        if len(token_ids) > self.max_model_len - generates:
            raise EngineError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}"
                + (": nothing would be left to generate" if generates else "")
            )
        vocab = self.vocab_size
        if max(token_ids) >= vocab or min(token_ids) < 0:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        if generates and params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids a request's sequences run under."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
