"""Offline inference with vLLM's names: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

``LLM`` steps its engine itself, through the engine's synchronous face (``SyncEngineClient``, fw.engine.client).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from fw.config import SLOTS, cli_options, load_config
from fw.engine.beam_search import beam_search
from fw.engine.client import SyncEngineClient
from fw.engine.core import LLMEngine
from fw.generation_config import sampling_defaults
from fw.inputs import PromptType, TokensPrompt, parse_prompts
from fw.interfaces.spec import canonical_kind
from fw.outputs import BeamSearchOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from fw.pooling import PoolingParams
from fw.sdk.chat import apply_chat_template
from fw.sdk.sampling_params import BeamSearchParams, SamplingParams
from fw.sdk.tokenizer import Tokenizer
from fw.tool_calls import ChatParsers, OutputReader, chat_params, tool_request


def _config_paths() -> dict[str, str]:
    """Keyword -> configuration path: the long flag names and aliases with underscores (``max_num_seqs``,
    ``attention``, ``quantization``)."""
    return {
        flag[2:].replace("-", "_"): o.path
        for o in cli_options()
        for flag in (o.flag, *o.aliases)
        if flag.startswith("--")
    }


class LLM:
    """Keyword arguments are the `fw` flags with underscores; ``config_files`` layers YAML/TOML files beneath them.

    ``plugin_options`` sets the options of each slot's plugin, as ``--plugin-option`` does:
    ``LLM(quant="int8", plugin_options={"quant": {"skip": ["o_proj"]}})``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config_files: Sequence[str] = (),
        plugin_options: dict[str, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        paths = _config_paths()
        unknown = sorted(set(kwargs) - set(paths))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(paths))}")
        values: dict[str, Any] = {"model": os.fspath(model) if model is not None else None, **kwargs}
        cli: dict[str, Any] = {}
        sources = {paths[k]: f"LLM({k}=...)" for k in values}
        for key, value in values.items():
            if value is not None and "." not in paths[key]:  # a whole section: speculative_config
                cli[paths[key]] = value
            elif value is not None:
                section, _, leaf = paths[key].partition(".")
                if leaf in cli.get(section, {}):
                    raise TypeError(f"LLM() got two arguments for {paths[key]} (an alias and its flag name)")
                cli.setdefault(section, {})[leaf] = value
        for kind, options in (plugin_options or {}).items():
            slot = canonical_kind(kind)
            if slot not in SLOTS:
                raise TypeError(f"LLM(plugin_options=...): {kind!r} is not a plugin slot ({', '.join(SLOTS)})")
            cli.setdefault(slot, {})["options"] = dict(options)
            sources.update({f"{slot}.options.{name}": "LLM(plugin_options=...)" for name in options})
        resolved = load_config(config_files, cli, sources)
        self.llm_engine: SyncEngineClient = LLMEngine(resolved.config)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.view.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no params: the model's generation_config.json defaults
        (per ``generation_config``), as vLLM's LLM does."""
        return SamplingParams(**sampling_defaults(self.llm_engine.view.config.model))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``use_tqdm``: a progress bar, or the tqdm class to draw it with. ``priority``: one per prompt, lower
        first; needs ``scheduling_policy="priority"``.
        """
        default = self.get_default_sampling_params()
        return self._run(prompts, sampling_params, default, priority, use_tqdm, lora_request)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        pooling_task: str = "embed",
        priority: Sequence[int] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt's final hidden states (fw.pooling: ``pooling=`` or the model's pooling config), in one
        batch with whatever else runs; outputs come back in prompt order, ``outputs.data`` a float32 tensor."""
        if pooling_task != "embed":
            raise ValueError(f"pooling_task {pooling_task!r}: fw pools for 'embed' only")
        return self._run(prompts, pooling_params, PoolingParams(), priority, use_tqdm, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """``encode`` with each vector as a list of floats (``outputs.embedding``), as vLLM's ``LLM.embed``."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                              priority=priority)
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def _run(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | PoolingParams | Sequence[SamplingParams | PoolingParams] | None,
        default: SamplingParams | PoolingParams,
        priority: Sequence[int] | None,
        use_tqdm: bool | Callable[..., tqdm],
        lora_request: Any,
    ) -> list:
        """Admit every prompt with its params (one for all, ``default`` if None) and step until all are finished;
        their outputs in prompt order."""
        if lora_request is not None:
            raise NotImplementedError("lora_request: fw does not serve LoRA adapters")
        prompts = parse_prompts(prompts)
        if params is None or isinstance(params, type(default)):
            params = [params or default] * len(prompts)
        priority = [0] * len(prompts) if priority is None else priority
        for name, values in ((type(default).__name__, params), ("priorities", priority)):
            if len(values) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(values)} {name}")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, request_params, rank in zip(prompts, params, priority, strict=True):
                ids.append(engine.add_request(prompt, request_params, priority=rank))
        except Exception:
            for request_id in ids:  # a bad prompt rejects the whole call
                engine.abort_request(request_id)
            raise
        bar = None
        if use_tqdm:
            bar_class = use_tqdm if callable(use_tqdm) else tqdm
            bar = bar_class(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        done: dict[str, RequestOutput | PoolingRequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:  # a failed step (RequestError: a request's constraint, say) fails the call
                engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate; ``RequestOutput.prompt`` is the
        rendered text. ``chat_template_kwargs`` reach the template (and may override the flags before them).

        ``tools`` are OpenAI tool dicts; ``tool_choice`` as in the chat API (fw.tool_calls): unset, "auto" when a
        ``tool_call_parser`` is configured, else "none"; "required" or ``{"type": "function", "function": {"name":
        ...}}`` constrain the output (a sampler with the "structured" feature). Each ``CompletionOutput`` then has
        ``tool_calls`` (None with tool_choice "none") and, with a ``reasoning_parser``, ``reasoning_content``;
        ``text`` stays the raw output."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r}: fw renders content "
                             "parts as strings ('auto' or 'string')")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: fw serves text-only models")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.view.tokenizer
        options = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            **(chat_template_kwargs or {}),
        }
        texts = [apply_chat_template(tokenizer, conv, template=chat_template, **options) for conv in conversations]
        prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False), prompt=text)
                   for text in texts]
        view = self.llm_engine.view
        parsers = ChatParsers.from_config(view.config.chat)
        request = tool_request(tools, tool_choice, None, parsers, server=False)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} conversations but {len(sampling_params)} sampling params")
        sampling_params = [chat_params(params, request, parsers, text, view)
                           for params, text in zip(sampling_params, texts, strict=True)]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out in outputs:
            for comp in out.outputs:
                message = OutputReader(parsers, request, tokenizer).read(comp.text)
                comp.tool_calls = message.tool_calls if request.choice != "none" else None
                comp.reasoning_content = message.reasoning
        return outputs

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (fw.engine.beam_search), for a sampler plugin with the "beam" feature (``sampler="beam"``)."""
        return beam_search(self.llm_engine, prompts, params)

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None and engine.runs_workers:
            engine.shutdown()
