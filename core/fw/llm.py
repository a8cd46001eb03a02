"""Offline inference with vLLM's names: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fw.chat import apply_chat_template
from fw.config import cli_options, load_config
from fw.engine import LLMEngine
from fw.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from fw.sampling_params import BeamSearchParams, SamplingParams


def _config_paths() -> dict[str, str]:
    """Keyword -> configuration path: the flag names with underscores (``max_num_seqs``, ``attention``)."""
    return {o.flag[2:].replace("-", "_"): o.path for o in cli_options()}


class LLM:
    """Keyword arguments are the `fw` flags with underscores; ``config_files`` layers YAML/TOML files beneath them."""

    def __init__(self, model: str | None = None, *, config_files: Sequence[str] = (), **kwargs: Any) -> None:
        paths = _config_paths()
        unknown = sorted(set(kwargs) - set(paths))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(paths))}")
        values: dict[str, Any] = {"model": os.fspath(model) if model is not None else None, **kwargs}
        cli: dict[str, Any] = {}
        for key, value in values.items():
            if value is not None:
                section, _, leaf = paths[key].partition(".")
                cli.setdefault(section, {})[leaf] = value
        resolved = load_config(config_files, cli, {paths[k]: f"LLM({k}=...)" for k in values})
        self.llm_engine = LLMEngine(resolved.config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        engine = self.llm_engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = [
            tokenizer.encode(apply_chat_template(tokenizer, conv, add_generation_prompt, chat_template),
                             add_special_tokens=False)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def beam_search(self, prompts: Sequence[str | list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search, for a sampler plugin with the "beam" feature (``sampler="beam"``)."""
        engine = self.llm_engine
        if "beam" not in engine.sampler_features:
            raise ValueError(
                f"beam search needs a sampler with the 'beam' feature (e.g. sampler='beam'); "
                f"the selected sampler is {engine.selected['sampler']!r}"
            )
        token_ids = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        results = engine.sampler.beam_search(engine, token_ids, params)
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        beam.tokens,
                        engine.tokenizer.decode(beam.tokens),
                        beam.logprob,
                        beam.score(params.length_penalty),
                        "stop" if beam.finished else "length",
                    )
                    for beam in beams
                ]
            )
            for beams in results
        ]

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None and engine.executor.group is not None:
            engine.shutdown()
