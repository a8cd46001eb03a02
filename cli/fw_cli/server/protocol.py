"""OpenAI request bodies, validated as OpenAI does, and their translation to SamplingParams.

As in vLLM, unknown fields are ignored with a logged warning, and vLLM's extra
fields (top_k, min_p, structured_outputs, prompt_logprobs, allowed_token_ids,
guided_*, ...) are honoured, so clients of vLLM work unchanged.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fw.sdk.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("fw.server")
# The structured_outputs keys fw's samplers implement (vLLM also has grammar and structural_tag).
STRUCTURED_KINDS = ("json", "regex", "choice", "json_object")


# Per-step costs grow with these (stop-string matching, logit_bias rows, stop-token lookups), so they are bounded;
# logit_bias at OpenAI's 300.
MAX_STOP_CHARS = 512
MAX_TOKEN_IDS = 300
MAX_BAD_WORDS = 100


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _check_unicode(data: dict[str, Any]) -> None:
    """Every string must encode: JSON allows a lone surrogate ("\\ud800"), which no tokenizer or response takes.
    (Serialized to find one, which takes milliseconds where walking a 4 MB body in Python would take a second.)"""
    for field, value in data.items():
        try:
            json.dumps([field, value], ensure_ascii=False, default=str).encode()
        except UnicodeEncodeError:
            raise ValueError(f"{field}: a lone surrogate is not valid Unicode text") from None


class _Lenient(BaseModel):
    """Unknown fields are dropped with a warning, as vLLM does (OpenAI answers 400)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_unicode(data)
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            if unknown := sorted(set(data) - known):
                log.warning("The following fields were present in the request but ignored: %s", unknown)
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchema(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class _SamplingFields(_Lenient):
    """Fields both endpoints share, with OpenAI's ranges (the engine re-checks its own)."""

    default_max_tokens: ClassVar[int | None]  # without max_tokens or a generation-config default; None: the cap
    logprobs_field: ClassVar[str]  # the field that asks for output logprobs

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_TOKEN_IDS)
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens; -1: max_model_len
    priority: int = 0
    request_id: str | None = Field(None, pattern=r"^[!-~]{1,256}$")  # printable ASCII: it goes back as a header

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if stops is not None and any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        return _truncation(value)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def resolve_max_tokens(self, prompt_len: int, max_model_len: int, defaults: dict[str, Any], cap: int) -> int:
        """The client's limit, else the generation config's or the endpoint's default, within ``cap``
        (--max-tokens-default) and the context left."""
        if (asked := self.token_limit()) is not None:
            return asked
        room = max(max_model_len - prompt_len, 1)
        default = defaults.get("max_tokens", self.default_max_tokens)
        return min(room, cap) if default is None else min(default, room, cap)

    def structured(self) -> StructuredOutputsParams | None:
        given = {
            "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
        }
        chosen = {k: v for k, v in given.items() if v is not None}
        if self.response_format is not None and self.response_format.type != "text":
            chosen["response_format"] = self.response_format
        if len(chosen) > 1:
            raise APIError(400, f"use only one of {', '.join(sorted(chosen))}", param=sorted(chosen)[1])
        if not chosen:
            return None
        (key, value), = chosen.items()
        if key == "structured_outputs":
            constraint = {k: v for k, v in value.items() if v is not None}  # clients send the unset kinds as null
            if unsupported := sorted(set(constraint) - set(STRUCTURED_KINDS)):
                raise APIError(400, f"structured_outputs: {', '.join(unsupported)} not supported; use one of "
                               f"{', '.join(STRUCTURED_KINDS)}", param="structured_outputs")
            return StructuredOutputsParams(**constraint)
        if key == "guided_json":
            return StructuredOutputsParams(json=value)
        if key == "guided_regex":
            return StructuredOutputsParams(regex=value)
        if key == "guided_choice":
            return StructuredOutputsParams(choice=value)
        if value.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if value.json_schema is None or value.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        return StructuredOutputsParams(json=json.dumps(value.json_schema.schema_))

    def sampling_params(self, defaults: dict[str, Any], max_logprobs: int) -> SamplingParams:
        """The request's settings; those it leaves unset come from ``defaults`` (the generation config), then the
        neutral values. max_tokens is left to ``resolve_max_tokens``, which needs the prompt."""
        logprobs, prompt_logprobs = self.num_logprobs(), self.num_prompt_logprobs()
        for name, value in ((self.logprobs_field, logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and value > max_logprobs:
                raise APIError(400, f"{name}: at most {max_logprobs} (--max-logprobs), got {value}", param=name)
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs are not available when streaming", param="prompt_logprobs")

        def unset_from_defaults(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=unset_from_defaults("temperature", 1.0),
            top_p=unset_from_defaults("top_p", 1.0),
            top_k=unset_from_defaults("top_k", 0),
            min_p=unset_from_defaults("min_p", 0.0),
            repetition_penalty=unset_from_defaults("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=None,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured(),
        )


def _truncation(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("must be -1 (max_model_len) or a positive number of tokens")
    return value


def _non_empty_prompts(value: Any, name: str) -> Any:
    if value in ("", [], [[]]):
        raise ValueError(f"the {name} must not be empty")
    return value


def _prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One prompt (a text, or token ids) or a list of them, as a list of prompts."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class CompletionRequest(_SamplingFields):
    default_max_tokens = 16  # OpenAI's
    logprobs_field = "logprobs"

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None  # refused, as vLLM does
    best_of: int | None = None  # accepted when it equals n
    add_special_tokens: bool = True

    def num_prompt_logprobs(self) -> int | None:
        # echo with logprobs returns the prompt's too (vLLM's rule)
        return self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        return _non_empty_prompts(value, "prompt")

    def prompts(self) -> list[str | list[int]]:
        return _prompt_list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (content parts are joined by fw.sdk.chat); no content is ""."""
        return {**self.model_dump(exclude_none=True), "content": "" if self.content is None else self.content}


class _ChatTemplateFields(_Lenient):
    """How chat messages become a prompt (vLLM's fields)."""

    add_generation_prompt: bool | None = None  # None: True, unless continue_final_message
    continue_final_message: bool = False
    # The template itself, never a path (a client must not read server files); refused unless the server was
    # started with --allow-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    default_max_tokens = None  # OpenAI's and vLLM's: as many as the context allows; here --max-tokens-default
    logprobs_field = "top_logprobs"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_special_tokens: bool = False  # the chat template writes the special tokens
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class EmbeddingRequest(_Lenient):
    """OpenAI's /v1/embeddings body, with vLLM's extras (truncate_prompt_tokens, add_special_tokens, normalize,
    priority, request_id)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens; -1: max_model_len
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the model's pooling config (by default, normalized)
    priority: int = 0
    request_id: str | None = Field(None, pattern=r"^[!-~]{1,256}$")  # printable ASCII: it goes back as a header

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        return _non_empty_prompts(value, "input")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        return _truncation(value)

    def inputs(self) -> list[str | list[int]]:
        return _prompt_list(self.input)
