"""Per-request sampling settings, with vLLM's names and ranges."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Below this a temperature means greedy; tiny positive values are clamped up to it so logits/T stays finite.
GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """An out-of-range sampling value; the message names the field and the allowed range."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class StructuredOutputsParams:
    """Constrain the output (exactly one of json, json_object, regex, choice): a JSON schema, any JSON object, a
    regex, or a choice. ``reasoning_end``: a reasoning model's output is free until it contains this text (e.g.
    "</think>", set by ``--reasoning-parser``); the constraint applies to the tokens after the one completing it."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        for name, kind in (("json", (str, dict)), ("regex", str), ("choice", list), ("json_object", bool),
                           ("reasoning_end", str)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise SamplingParamsError(f"structured_outputs.{name}", f"has the wrong type: {type(value).__name__}")
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", f"set exactly one of json, json_object, regex, choice (got {given or 'none'})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs.choice", "must be a non-empty list of non-empty strings")

    def key(self) -> tuple[str, str]:
        """A hashable description, for caching compiled constraints."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return ("json", schema)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        return ("choice", json.dumps(self.choice))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N log-probabilities per output token (0: only the chosen token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, empty text (and no stop strings)
    # Only these tokens may be generated.
    allowed_token_ids: list[int] | None = None
    # Never generate these words: a word's last token is banned where the output ends with the tokens before it.
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens (-1: max_model_len)
    # End the request when an n-gram of this size repeats `repetition_max_repeats` times in a row (0: off).
    repetition_ngram_size: int = 0
    repetition_max_repeats: int = 0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        max_tokens = self.max_tokens
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must be a 64-bit signed integer"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (disabled) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "must be in (0, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", max_tokens is None or max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0 and (max_tokens is None or self.min_tokens <= max_tokens),
             "must be >= 0 and <= max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("repetition_ngram_size", self.repetition_ngram_size >= 0, "must be >= 0"),
            ("repetition_max_repeats", self.repetition_max_repeats >= 0 and
             (self.repetition_ngram_size == 0 or self.repetition_max_repeats >= 2),
             "must be >= 2 when repetition_ngram_size is set"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative token ids"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                self.allowed_token_ids and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
             "must be a non-empty list of non-negative token ids"),
            ("bad_words", all(isinstance(w, str) and w.strip() for w in self.bad_words), "must be non-blank strings"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
             "must be -1 (max_model_len) or >= 1"),
            ("stop", self.detokenize or not self.stop, "needs detokenize=True"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise SamplingParamsError(name, f"{message}, got {getattr(self, name)!r}")
        try:  # JSON clients send token ids as strings
            self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        except (TypeError, ValueError):
            raise SamplingParamsError("logit_bias", "must map token ids to numbers") from None
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise SamplingParamsError("logit_bias", f"token ids must be non-negative, got {token}")
            if not -100 <= bias <= 100:
                raise SamplingParamsError("logit_bias", f"bias of token {token} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class BeamSearchParams:
    """vLLM's beam-search settings; run with ``LLM.beam_search`` and a sampler that has the "beam" feature."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # score = cumulative logprob / generated_length ** length_penalty
    early_stopping: bool = False  # stop a prompt once beam_width hypotheses have finished

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= 10:
            raise SamplingParamsError("beam_width", f"must be in [1, 10], got {self.beam_width}")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
