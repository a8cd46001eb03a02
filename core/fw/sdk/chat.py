"""Chat templates: turn a list of messages into the prompt text a model was trained on."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:  # fw.sdk.tokenizer imports this module
    from fw.sdk.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template failed on these messages."""


# Compiled templates kept, least recently used dropped: a server given many distinct templates stays bounded.
TEMPLATE_CACHE_SIZE = 32


def _raise(message: str) -> None:
    # Templates call raise_exception() to reject conversations they cannot render.
    raise TemplateError(message)


@lru_cache(maxsize=TEMPLATE_CACHE_SIZE)
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


def _part_text(part: Any, index: int) -> str:
    """A content part's text: a plain string, or a 'text' (or 'refusal') part, whose "type" may be left out."""
    if isinstance(part, str):
        return part
    kind = type(part).__name__
    if isinstance(part, dict):
        kind = part.get("type", "text" if "text" in part else None)
        if kind in ("text", "refusal"):
            if isinstance(part.get(kind), str):
                return part[kind]
            raise ChatTemplateError(f"messages[{index}]: a {kind!r} content part needs a string {kind!r}")
    raise ChatTemplateError(
        f"messages[{index}]: content part type {kind!r} is not supported; fw serves text-only models "
        "(content parts of type 'text' only)"
    )


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages -> what templates expect: a list of content parts becomes its texts joined by
    newlines (as vLLM renders them). Returns new dicts; the input is left alone."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    return [
        {**m, "content": "\n".join(_part_text(p, i) for p in m["content"])} if isinstance(m.get("content"), list) else m
        for i, m in enumerate(messages)
    ]


def _open_final_message(rendered: str, content: Any) -> str:
    """Cut the rendering right after the final message's text, so the model continues that message."""
    text = content.strip() if isinstance(content, str) else ""
    at = rendered.rfind(text) if text else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message has no text that the template renders")
    end = at + len(text)
    trailing = content[len(content.rstrip()) :]
    # Keep the message's own trailing whitespace where the template kept it.
    return rendered[: end + len(trailing)] if rendered.startswith(trailing, end) else rendered[:end]


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    variables: dict[str, Any] | None = None,
    max_chars: int | None = None,
) -> str:
    """Render ``messages`` (normalized first) with ``template``; ``variables`` reach the template too.

    ``continue_final_message`` leaves the final message open (no end-of-turn after it) for the model to
    continue, e.g. a prefilled assistant reply; it excludes ``add_generation_prompt``. ``max_chars`` stops a
    rendering that grows past it (`fw serve` also runs this in a worker process, under a time limit).
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be set: the first continues the final "
            "message, the second starts a new assistant message"
        )
    messages = normalize_messages(messages)
    context = {**(variables or {}), "messages": messages, "add_generation_prompt": add_generation_prompt}
    pieces, size = [], 0
    try:
        for piece in _compile(template).generate(context):
            size += len(piece)
            if max_chars is not None and size > max_chars:
                raise ChatTemplateError(f"the chat template's output is longer than {max_chars} characters")
            pieces.append(piece)
    except ChatTemplateError:
        raise
    except Exception as exc:  # a template can fail on a conversation in any way (TypeError, RecursionError, ...)
        detail = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
        raise ChatTemplateError(f"the chat template failed: {detail}") from None
    rendered = "".join(pieces)
    if continue_final_message:
        rendered = _open_final_message(rendered, messages[-1].get("content") if messages else None)
    return rendered


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template: str | None = None,
    *,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """``render_chat`` with ``template`` or the model's, and the tokenizer's special tokens; ``kwargs`` reach the
    template."""
    template = template or tokenizer.chat_template
    if not template:
        raise ChatTemplateError("the model has no chat template; pass one with --chat-template")
    special = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    return render_chat(template, messages, add_generation_prompt, continue_final_message, {**special, **kwargs})
