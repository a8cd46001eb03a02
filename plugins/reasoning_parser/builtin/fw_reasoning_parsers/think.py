"""Reasoning between ``<think>`` and ``</think>``: DeepSeek-R1's and Qwen3's, which differ only where the tag opens."""

from __future__ import annotations

from typing import ClassVar

from fw.interfaces.reasoning_parser import ReasoningParser

START, END = "<think>", "</think>"


class ThinkParser(ReasoningParser):
    markers = (START, END)
    end_marker = END
    # Whether an output that does not open with <think> reasons anyway (the template opened the tag in the prompt).
    opened_in_prompt: ClassVar[bool]

    def split(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START) :]
        elif START.startswith(body):  # nothing yet but whitespace, or the tag's start: undecided
            return None, None
        elif self.opened_in_prompt:
            body = text
        else:
            return None, text
        reasoning, end, content = body.partition(END)
        return reasoning or None, content if end else None


class DeepSeekR1(ThinkParser):
    opened_in_prompt = True


class Qwen3(ThinkParser):
    opened_in_prompt = False
