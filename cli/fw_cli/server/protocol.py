"""OpenAI request bodies, validated as OpenAI does, and their translation to SamplingParams.

Unknown fields are rejected (as OpenAI does); vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, guided_*, ...) are accepted so clients of
vLLM work unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fw.sampling_params import SamplingParams, StructuredOutputsParams


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share, with OpenAI's ranges (the engine re-checks its own)."""

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return stops

    def structured(self, response_format: ResponseFormat | None = None) -> StructuredOutputsParams | None:
        given = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
        }
        chosen = {k: v for k, v in given.items() if v is not None}
        if response_format is not None and response_format.type != "text":
            chosen["response_format"] = response_format
        if len(chosen) > 1:
            raise APIError(400, f"use only one of {', '.join(sorted(chosen))}", param=sorted(chosen)[1])
        if not chosen:
            return None
        (key, value), = chosen.items()
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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, response_format=None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured(response_format),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value in ("", [], [[]]):
            raise ValueError("the prompt must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class JSONSchema(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def flat(self) -> dict[str, Any]:
        """The message with text parts joined, as chat templates expect."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "".join(part.get("text", "") for part in content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
