"""The configuration tree and where each value came from.

Sources, later wins: field defaults < config files (``--config`` YAML/TOML,
deep-merged in order) < ``FW_<SECTION>__<FIELD>`` environment variables
(and the vLLM-like names of ``ENV_ALIASES``) < command-line flags. Every leaf
remembers its source for ``fw config show``. A bad value fails naming its
field path, its source and the reason.

Command-line flags for the core sections are derived from the field names
(``scheduler.max_num_seqs`` is ``--max-num-seqs``; a plugin slot's name is
``--attention`` and so on), so the flags, the files and the environment can
never drift apart. Hooks plugins add sections with ``fw_config_sections`` and
flags with ``fw_cli_options``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from fw.interfaces.attention import KVCacheDtype
from fw.interfaces.hooks import CliOption
from fw.interfaces.spec import canonical_kind

ENV_PREFIX = "FW_"


class ConfigError(ValueError):
    """An invalid configuration value; the message names field, source and reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    model: str | None = Field(None, description="Model directory (config.json + safetensors) or .gguf file.")
    tokenizer: str | None = Field(None, description="Tokenizer directory, if not the model's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Activation and weight dtype; auto takes the checkpoint's (bfloat16 for float16 on CPU)."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Context length; defaults to the model's, lowered to what the KV cache holds (with a "
        "warning); auto or -1: the same, as vLLM's --max-model-len auto."
    )
    seed: int = Field(0, description="Seed for weights-independent randomness (unseeded sampling).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device to run on.")
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for requests that leave them unset: auto takes the model's "
        "generation_config.json, vllm ignores it, a folder path reads that folder's file.",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly: on the CPU, fw otherwise records a decode step of up to 32 requests once "
        "per batch size that recurs and replays it without Python (fw.decode_graph).",
    )
    pooling: Literal["auto", "last", "mean", "cls"] = Field(
        "auto",
        description="How embeddings pool a prompt's final hidden states: the last token's, their mean, or the first "
        "(CLS) token's; auto takes the model's sentence-transformers config (modules.json), else last with L2 "
        "normalization, as vLLM does for a decoder.",
    )

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _auto_length(cls, value: Any) -> Any:
        return None if value in ("auto", "-1", -1) else value

    @field_validator("generation_config")
    @classmethod
    def _generation_config_folder(cls, value: str) -> str:
        if value not in ("auto", "vllm") and not (Path(value) / "generation_config.json").is_file():
            raise ValueError("expected auto, vllm or a folder holding generation_config.json")
        return value


class CacheSection(_Section):
    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    kv_cache_memory: ByteSize | None = Field(
        None, description="Bytes for the KV cache (e.g. 2GiB); default: 1 GiB on CPU, gpu_memory_utilization on CUDA."
    )
    num_kv_blocks: int | None = Field(
        None, gt=0, description="Exact number of KV-cache blocks, overriding the memory budget (vLLM: num_gpu_blocks_override)."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of GPU memory the engine may use.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="KV-cache dtype: auto (the model's), fp8 (e4m3) or int8, about half the bytes of bf16."
    )


class SchedulerSection(_Section):
    max_num_seqs: int = Field(256, gt=0, description="Most requests in one batch.")
    max_num_batched_tokens: int | None = Field(
        None, gt=0,
        description="Token budget of one engine step. Unset: 2048 on a GPU; 512 on a CPU, where a step costs in "
        "proportion to its tokens already at a few hundred, so smaller steps start a burst's requests sooner (p50 "
        "TTFT of 32 x 128-token prompts 38 s -> 25 s on a 2-core EPYC) at the same throughput.",
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps, mixed with decodes.")
    long_prefill_token_threshold: int | None = Field(
        None, ge=0,
        description="Most prompt tokens one request computes in a step with chunked prefill, so that a long prompt "
        "shares the step's budget with the requests behind it (vLLM's name; 0: no limit). Unset: a quarter of "
        "max_num_batched_tokens.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="Order of admission.")


class ParallelSection(_Section):
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel worker processes.")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline stages: the decoder layers split into contiguous runs, one per stage."
    )
    pp_layer_partition: list[int] | None = Field(
        None,
        description='Decoder layers per pipeline stage, comma-separated ("1,3"), as vLLM\'s VLLM_PP_LAYER_PARTITION; '
        "also FW_PP_LAYER_PARTITION. Unset: an even split.",
    )
    data_parallel_size: int = Field(1, ge=1, description="Data-parallel replicas.")
    enable_expert_parallel: bool = Field(
        False,
        description="Shard each MoE layer's experts over the tensor- and data-parallel ranks (whole experts per rank, "
        "tokens routed by the comm plugin's dispatch/combine) instead of splitting every expert's width; "
        "data-parallel replicas then step in lockstep.",
    )
    distributed_timeout: float = Field(120.0, gt=0, description="Seconds to wait for collectives and workers.")
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="How tensor/pipeline-parallel workers start: mp, processes on this machine; ray, actors on the "
        "running Ray cluster (RAY_ADDRESS, else the local one), so that the ranks can span machines.",
    )

    @field_validator("pp_layer_partition", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        # "1,3", as the environment and the command line give it
        return [part.strip() for part in value.split(",")] if isinstance(value, str) else value


class ChatSection(_Section):
    """How chat outputs are read (vLLM's flags): tool calls and reasoning, each by a parser plugin."""

    enable_auto_tool_choice: bool = Field(
        False, description='Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.'
    )
    tool_call_parser: str | None = Field(
        None, description="The tool_parsers plugin that reads the model's tool calls (hermes, llama3_json, mistral, "
        "pythonic, ...; `fw plugins list`).",
    )
    reasoning_parser: str | None = Field(
        None, description="The reasoning_parsers plugin that splits reasoning_content from content (deepseek_r1, qwen3, "
        "...).",
    )


class PluginChoice(_Section):
    """A slot's plugin: its name ("auto" lets the core choose) and its options."""

    name: str | None
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        # "attention: flashinfer" in a file is shorthand for {name: flashinfer}.
        return {"name": value} if isinstance(value, str) or value is None else value

    @field_validator("name")
    @classmethod
    def _strip(cls, value: str | None) -> str | None:
        return value.strip() or None if value is not None else None


def _choice(default: str | None, description: str) -> Any:
    return Field(default_factory=lambda: PluginChoice(name=default), description=description)


class SpeculativeConfig(_Section):
    """Speculative decoding, with vLLM's keys (``--speculative-config '{"method": "ngram", ...}'``). Keys other
    than these go to the proposer as its options (``prompt_lookup_max`` for ngram); ``model`` does too."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    method: str | None = Field(
        None, description="The spec_proposers plugin (ngram, draft_model, mtp, ...); draft_model when only model is set."
    )
    model: str | None = Field(None, description="The draft model's directory (method draft_model).")
    num_speculative_tokens: int | None = Field(None, ge=1, description="k: the most draft tokens per request and step.")
    disable_by_batch_size: int | None = Field(
        None, ge=2,
        description="Propose no drafts while more requests than this run (on a CPU a step costs in proportion to "
        "its tokens, so verifying drafts of a large batch loses); unset: 4 on a CPU (the measured crossover), no "
        "limit on a GPU.",
    )

    @model_validator(mode="after")
    def _method(self) -> SpeculativeConfig:
        if self.method is None:
            if self.model is None:
                raise ValueError("give speculative_config.method (e.g. ngram) or speculative_config.model")
            self.method = "draft_model"
        return self

    def proposer_options(self) -> dict[str, Any]:
        """The keys the proposer reads: everything the core does not."""
        return {**(self.model_extra or {}), **({"model": self.model} if self.model is not None else {})}


class ServerSection(_Section):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    api_key: SecretStr | None = Field(
        None, description="Require this bearer token on every route but /health. A flag shows in `ps`: prefer "
        "FW_SERVER__API_KEY or --api-key-file."
    )
    api_key_file: Path | None = Field(None, description="Read the API key from this file.")
    public_metrics: bool = Field(False, description="Serve /metrics without the API key.")
    public_docs: bool = Field(False, description="Serve /docs, /redoc and /openapi.json without the API key.")
    served_model_name: str | None = Field(None, description="Model name clients use; defaults to the model path.")
    chat_template: str | None = Field(None, description="Jinja chat template file or string overriding the model's.")
    allow_request_chat_template: bool = Field(
        False, description="Let requests bring their own chat_template (a risk: see the README)."
    )
    max_tokens_default: int = Field(
        4096, ge=1, description="Cap on max_tokens when a request leaves it unset (vLLM: the whole context left)."
    )
    max_request_bytes: ByteSize = Field(4 * 1024**2, gt=0, description="Largest request body; larger ones get 413.")
    max_num_waiting: int = Field(
        256, ge=1, description="Requests waiting to start generating, at most; beyond, 429 with Retry-After."
    )
    max_prompts_per_request: int = Field(
        64, ge=1, description="Longest prompt list of one /v1/completions request (and input list of /v1/embeddings)."
    )
    max_logprobs: int = Field(
        20, ge=0, le=20, description="Most logprobs (and prompt_logprobs) a request may ask for; 20 is also the engine's limit."
    )
    disable_log_requests: bool = Field(False, description="Don't log a line per request received.")
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="uvicorn's log level; info logs each HTTP request (its access log)."
    )

    @model_validator(mode="before")
    @classmethod
    def _key_from_file(cls, data: Any) -> Any:
        """The key is the file's content: it shows neither in `ps` nor in the environment."""
        if isinstance(data, dict) and data.get("api_key_file") is not None:
            if data.get("api_key") is not None:
                raise ValueError("give the API key once: api_key or api_key_file")
            try:
                key = Path(data["api_key_file"]).read_text().strip()
            except OSError as exc:
                raise ValueError(f"api_key_file: {exc}") from None
            if not key:
                raise ValueError(f"api_key_file: {data['api_key_file']} is empty")
            return {**data, "api_key": key}
        return data

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("an empty API key would let everyone in; leave it unset to serve without one")
        return value


class FwConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    model: ModelSection = Field(default_factory=ModelSection)
    cache: CacheSection = Field(default_factory=CacheSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    attention: PluginChoice = _choice("auto", "Attention backend plugin.")
    quant: PluginChoice = _choice("auto", "Quantization plugin; auto follows the checkpoint.")
    comm: PluginChoice = _choice("torch", "Communication plugin for multi-process runs.")
    kv_connector: PluginChoice = _choice(None, "KV connector plugin (none by default).")
    sampler: PluginChoice = _choice("auto", "Sampler plugin; auto picks the most capable one installed.")
    chat: ChatSection = Field(default_factory=ChatSection)
    server: ServerSection = Field(default_factory=ServerSection)
    speculative_config: SpeculativeConfig | None = Field(
        None, description='Speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\'.'
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_json(cls, value: Any) -> Any:
        # The flag and the environment give JSON text.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        return value

    def plugin_choice(self, kind: str) -> PluginChoice:
        return getattr(self, canonical_kind(kind))


# The plugin kinds chosen per run; each is also the config field holding its choice.
SLOTS = ("attention", "quant", "comm", "kv_connector", "sampler")
# Sections whose flags are derived from field names; "server" flags only exist on `fw serve`.
ENGINE_SECTIONS = ("model", "cache", "scheduler", "parallel", "chat")
SERVER_SECTIONS = ("server",)
# Flag spellings that differ from the field name (the vLLM spelling stays available).
FLAG_ALIASES = {
    "parallel.tensor_parallel_size": ("-tp",),
    "parallel.pipeline_parallel_size": ("-pp",),
    "parallel.data_parallel_size": ("-dp",),
    "quant.name": ("--quantization", "-q"),
    "attention.name": ("--attention-backend",),
    "server.max_num_waiting": ("--max-queue-len",),
}
# Environment variables outside the FW_SECTION__FIELD scheme, spelt as vLLM's (VLLM_PP_LAYER_PARTITION); the
# FW_SECTION__FIELD one wins where both are set.
ENV_ALIASES = {"FW_PP_LAYER_PARTITION": "parallel.pp_layer_partition"}


def _hook():
    from fw.plugins import get_plugin_manager

    return get_plugin_manager().hook


def config_class() -> type[FwConfig]:
    """FwConfig plus the sections hooks plugins contribute."""
    extra: dict[str, Any] = {}
    for contributed in _hook().fw_config_sections():
        for name, model in (contributed or {}).items():
            if name in FwConfig.model_fields or name in extra:
                raise ConfigError(f"a hooks plugin contributes config section {name!r}, which already exists")
            extra[name] = (model, Field(default_factory=model))
    if not extra:
        return FwConfig
    return create_model("FwConfig", __base__=FwConfig, **extra)


def picklable(config: FwConfig) -> dict[str, Any]:
    """The configuration as plain data for another process (``config_class().model_validate`` rebuilds it), the
    API key included: a dump masks secrets."""
    data = config.model_dump(mode="json")
    if config.server.api_key is not None:
        data["server"]["api_key"] = config.server.api_key.get_secret_value()
    return data


def cli_options(sections: tuple[str, ...] = ENGINE_SECTIONS) -> list[CliOption]:
    """Flags for the given core sections, the plugin slots, and hooks plugins' contributions."""
    out = []
    for section in sections:
        for name, info in FwConfig.model_fields[section].annotation.model_fields.items():
            path = f"{section}.{name}"
            annotation = info.annotation
            choices = getattr(annotation, "__args__", None) if getattr(annotation, "__origin__", None) is Literal else None
            out.append(
                CliOption(
                    flag="--" + name.replace("_", "-"),
                    path=path,
                    help=info.description or "",
                    is_flag=annotation is bool,
                    choices=tuple(choices) if choices else None,
                    aliases=FLAG_ALIASES.get(path, ()),
                )
            )
    if sections == ENGINE_SECTIONS:
        for kind in SLOTS:
            path = f"{kind}.name"
            flag = "--" + kind.replace("_", "-")
            out.append(CliOption(flag, path, FwConfig.model_fields[kind].description or "", aliases=FLAG_ALIASES.get(path, ())))
        spec = FwConfig.model_fields["speculative_config"]
        out.append(CliOption("--speculative-config", "speculative_config", spec.description or ""))
        for contributed in _hook().fw_cli_options():
            out.extend(contributed or [])
    return out


def parse_plugin_options(items: list[str]) -> dict[str, Any]:
    """``--plugin-option sampler.mass=0.9`` items -> ``{"sampler": {"options": {"mass": "0.9"}}}``.

    Values stay text; the plugin's ``PluginSpec.parse_options`` reads lists and mappings from it.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        kind, dot, option = key.partition(".")
        kind = canonical_kind(kind)
        if not sep or not dot or kind not in SLOTS or not option:
            raise ConfigError(
                f"--plugin-option {item!r}: expected KIND.OPTION=VALUE with KIND one of {', '.join(SLOTS)}"
            )
        out.setdefault(kind, {}).setdefault("options", {})[option] = value
    return out


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _file_values(cls: type[FwConfig], path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    suffix = file.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            return YamlConfigSettingsSource(cls, yaml_file=file)()
        if suffix == ".toml":
            return TomlConfigSettingsSource(cls, toml_file=file)()
    except Exception as exc:
        raise ConfigError(f"--config {path}: cannot parse: {exc}") from exc
    raise ConfigError(f"--config {path}: unknown format {suffix or '(none)'} (use .yaml, .yml or .toml)")


def _merge(into: dict[str, Any], values: dict[str, Any], source: str, sources: dict[str, str], prefix: str = "") -> None:
    """Deep-merge ``values`` into ``into`` (dicts merge, anything else replaces), recording each leaf's source."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, source, sources, path + ".")
        elif isinstance(value, dict):
            into[key] = {}
            _merge(into[key], value, source, sources, path + ".")
        else:
            into[key] = copy.deepcopy(value)
            for stale in [p for p in sources if p.startswith(path + ".")]:
                del sources[stale]
            sources[path] = source


@dataclass
class ResolvedConfig:
    config: FwConfig
    sources: dict[str, str]  # leaf path -> "default" | file path | "env FW_..." | "--flag"

    def source(self, path: str) -> str:
        return _source_of(self.sources, path)


def _source_of(sources: dict[str, str], path: str) -> str:
    """The source of ``path``, of the nearest parent set as a whole, or of what was set beneath it (a section
    that is not in the schema has only leaves)."""
    below = [source for leaf, source in sources.items() if leaf.startswith(path + ".")]
    while path:
        if path in sources:
            return sources[path]
        path = path.rpartition(".")[0]
    return below[0] if below else "default"


def _env_name(path: str) -> str:
    return ENV_PREFIX + path.replace(".", "__").upper()


def load_config(
    files: list[str] | tuple[str, ...] = (),
    cli: dict[str, Any] | None = None,
    cli_flags: dict[str, str] | None = None,
) -> ResolvedConfig:
    """Merge the sources and validate. ``cli`` is a nested dict; ``cli_flags`` maps its paths to flag names."""
    cls = config_class()
    # Plugin slots start from their defaults, so that setting only a slot's options keeps its default name.
    merged: dict[str, Any] = {f: cls.model_fields[f].default_factory().model_dump() for f in SLOTS}
    sources: dict[str, str] = {}
    for path in files:
        _merge(merged, _file_values(cls, path), path, sources)
    try:
        env_values = EnvSettingsSource(cls, env_prefix=ENV_PREFIX, env_nested_delimiter="__")()
    except SettingsError as exc:
        raise ConfigError(f"environment: {exc} (nested fields are set as {ENV_PREFIX}SECTION__FIELD)") from None
    for name, path in ENV_ALIASES.items():
        if name in os.environ:
            aliased: dict[str, Any] = {}
            set_path(aliased, path, os.environ[name])
            _merge(merged, aliased, f"env {name}", sources)
    env_sources: dict[str, str] = {}
    _merge(merged, env_values, "env", env_sources)
    sources.update({p: f"env {_env_name(p)}" for p in env_sources})
    cli_sources: dict[str, str] = {}
    _merge(merged, cli or {}, "cli", cli_sources)
    sources.update({p: (cli_flags or {}).get(p, "command line") for p in cli_sources})
    try:
        config = cls.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, merged, sources, cls)) from None
    return ResolvedConfig(config, sources)


def _format_errors(exc: ValidationError, merged: dict[str, Any], sources: dict[str, str], cls: type[FwConfig]) -> str:
    lines = ["invalid configuration:"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        where = _source_of(sources, path)
        value = merged
        for part in err["loc"]:
            value = value.get(part) if isinstance(value, dict) else None
        shown = f" = {value!r}" if value is not None and not isinstance(value, dict) else ""
        hint = _did_you_mean(cls, err["loc"]) if err["type"] == "extra_forbidden" else ""
        lines.append(f"  {path}{shown} (from {where}): {err['msg']}{hint}")
    return "\n".join(lines)


def _did_you_mean(cls: type[BaseModel], loc: tuple) -> str:
    """For a key the schema lacks: the known key it most likely misspells."""
    model: Any = cls
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = field.annotation if field is not None else None
    close = difflib.get_close_matches(str(loc[-1]), list(getattr(model, "model_fields", {})), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def show(resolved: ResolvedConfig) -> str:
    """The effective configuration as YAML, each value annotated with its source."""
    data = resolved.config.model_dump(mode="json")
    lines: list[str] = []

    def walk(node: dict[str, Any], prefix: str, indent: int) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, dict) and value:
                lines.append(f"{pad}{key}:")
                walk(value, path + ".", indent + 1)
            else:
                lines.append(f"{pad}{key}: {json.dumps(value)}  # {resolved.source(path)}")

    walk(data, "", 0)
    return "\n".join(lines)
