"""A hooks plugin for tests: scripted outputs from a random-weight model.

A random model never writes a tool call or a ``<think>`` block by itself; a test that needs one (to drive a
parser end to end through `fw serve` or ``LLM.chat``) registers this module under the ``fw.hooks`` entry-point
group and sets ``FW_TEST_SCRIPTS`` to JSON ``{seed: {"text": ..., "then": "eos" | "free"}}``. A request whose
``seed`` is a key is forced to write ``text`` token by token, then to end ("eos") or to go on sampling ("free":
e.g. a constraint takes over after a scripted reasoning). Other requests are left alone.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from fw.interfaces.hooks import EngineView, hookimpl

ENV = "FW_TEST_SCRIPTS"


def engine_view(engine: EngineView) -> EngineView:
    """What the hook calls ``engine`` is the engine's read-only view (fw.interfaces.hooks.EngineView)."""
    return engine


@hookimpl
def fw_logits_processors(sampling_params: Any, engine: Any) -> list:
    script = json.loads(os.environ.get(ENV, "{}")).get(str(sampling_params.seed))
    if script is None:
        return []
    tokenizer = engine_view(engine).tokenizer
    tokens = tokenizer.encode(script["text"], add_special_tokens=False)
    if script.get("then", "eos") == "eos":
        tokens.append(tokenizer.eos_token_id)

    def force(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) >= len(tokens):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[tokens[len(output_token_ids)]] = 0.0
        return forced

    return [force]
