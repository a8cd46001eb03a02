"""Prompt forms, with vLLM's names: a str, ``TextPrompt``, ``TokensPrompt``, or a list of token ids."""

from __future__ import annotations

from typing import Any, TypedDict


class _PromptOptions(TypedDict, total=False):
    # vLLM's multimodal fields are declared so that typed scripts check; fw serves text-only models, so
    # a non-empty one is an error.
    multi_modal_data: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    multi_modal_uuids: dict[str, Any]
    cache_salt: str  # keeps this prompt's prefix-cache blocks apart from other salts'


class TextPrompt(_PromptOptions):
    prompt: str


class _TokensPromptOptions(_PromptOptions, total=False):
    prompt: str  # the text of the token ids, where known: reported as RequestOutput.prompt
    token_type_ids: list[int]  # cross-encoders only: must be empty


class TokensPrompt(_TokensPromptOptions):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt

_UNSUPPORTED = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids")
_FIELDS = {"prompt", "prompt_token_ids", "cache_salt", *_UNSUPPORTED}
_ACCEPTED = (
    "a str, a TextPrompt {'prompt': str}, a TokensPrompt {'prompt_token_ids': list[int]} or a list of token ids"
)


def _form_error(problem: str) -> TypeError:
    return TypeError(f"{problem}; a prompt must be {_ACCEPTED}")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_prompt(prompt: PromptType) -> TextPrompt | TokensPrompt:
    """One prompt in any accepted form -> a new, checked TextPrompt or TokensPrompt."""
    if isinstance(prompt, str):
        return TextPrompt(prompt=prompt)
    if _is_token_ids(prompt):
        return TokensPrompt(prompt_token_ids=list(prompt))
    if not isinstance(prompt, dict):
        raise _form_error(f"got a {type(prompt).__name__}")
    unknown = sorted(set(prompt) - _FIELDS)
    if unknown:
        raise _form_error(f"unknown prompt field(s) {', '.join(unknown)}")
    for name in _UNSUPPORTED:
        if prompt.get(name):
            raise ValueError(f"{name}: fw serves text-only models; multimodal and cross-encoder inputs are unsupported")
    text, salt = prompt.get("prompt"), prompt.get("cache_salt")
    if text is not None and not isinstance(text, str):
        raise _form_error(f"'prompt' is a {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        if not _is_token_ids(prompt["prompt_token_ids"]):
            raise _form_error("'prompt_token_ids' is not a list of int token ids")
        parsed: TextPrompt | TokensPrompt = TokensPrompt(prompt_token_ids=list(prompt["prompt_token_ids"]))
        if text is not None:
            parsed["prompt"] = text
    elif text is not None:
        parsed = TextPrompt(prompt=text)
    else:
        raise _form_error("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise ValueError("cache_salt must be a non-empty str")
        parsed["cache_salt"] = salt
    return parsed


def parse_prompts(prompts: PromptType | list[PromptType]) -> list[TextPrompt | TokensPrompt]:
    """``LLM.generate``'s prompts: one prompt, or a list of them in any mix of forms."""
    if isinstance(prompts, (str, dict)) or (_is_token_ids(prompts) and prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, (list, tuple)):
        return [parse_prompt(p) for p in prompts]
    raise TypeError(f"prompts must be {_ACCEPTED}, or a list of these; got {type(prompts).__name__}")
