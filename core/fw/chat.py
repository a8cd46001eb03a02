"""Chat templates: turn a list of messages into the prompt text a model was trained on."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fw.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template failed on these messages."""


def _raise(message: str) -> None:
    # Templates call raise_exception() to reject conversations they cannot render.
    raise TemplateError(message)


@cache
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def load_template(template: str | None) -> str | None:
    """``--chat-template``: a file path or the template itself."""
    if template is None:
        return None
    path = Path(template)
    return path.read_text() if len(template) < 4096 and path.is_file() else template


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template: str | None = None,
    **kwargs: Any,
) -> str:
    template = template or tokenizer.chat_template
    if not template:
        raise ChatTemplateError("the model has no chat template; pass one with --chat-template")
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **kwargs,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from None
