"""Can this model run with these plugins on this device? Every reason it cannot.

Used by every command before anything heavy happens: it reads capability
records, imports only the implementation chosen for each slot (so that a
typo in a spec's ``impl`` is caught here, not at the first request), and
reports all problems at once, with the plugins of each failing slot that
would work instead. The model path's checkpoint format is resolved first
(``checkpoint_format``): it reads the config whose ``quantization_config``
names the quant format the quant slot must load.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fw import model_registry, plugins
from fw.config import SLOTS, FwConfig
from fw.interfaces.base import Requirements
from fw.interfaces.checkpoint_format import API_VERSION as FORMAT_API_VERSION
from fw.interfaces.checkpoint_format import CheckpointFormat, CheckpointFormatCapabilities
from fw.interfaces.spec import PluginError, PluginSpec
from fw.platform import DeviceInfo, detect
from fw.sdk.errors import ModelError

# The core's checkpoint format: what reads a path that no format plugin claims.
DIRECTORY_FORMAT = PluginSpec(
    name="directory",
    kind="checkpoint_format",
    impl="fw.model_loader:DirectoryFormat",
    capabilities=CheckpointFormatCapabilities(),
    api_version=FORMAT_API_VERSION,
    description="A model directory: config.json, safetensors and tokenizer.json (fw's own format).",
)


@dataclass
class CheckResult:
    requirements: Requirements
    selected: dict[str, PluginSpec] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # kind -> parsed options
    problems: list[str] = field(default_factory=list)
    alternatives: dict[str, list[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # kind -> why its plugin was chosen
    broken: list[str] = field(default_factory=list)  # plugins auto passed over: their implementation does not import

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        lines = [f"cannot run this combination ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        for kind, names in self.alternatives.items():
            lines.append(f"  usable {kind} plugins here: {', '.join(names) or 'none'}")
        return "\n".join(lines)


def _cpu_dtype(dtype: str, device: str) -> str:
    # float16 has no fast kernels on CPUs without AVX512-FP16/AMX: serve checkpoints stored in it as bfloat16.
    return "bfloat16" if device == "cpu" and dtype == "float16" else dtype


def model_requirements(config: FwConfig, device: DeviceInfo, hf_config: dict[str, Any] | None) -> Requirements:
    quant_format = None
    dtype = None if config.model.dtype == "auto" else config.model.dtype
    head_size = arch = mla_dims = None
    features: set[str] = set()  # the attention features the model needs
    hook = plugins.get_plugin_manager().hook
    if config.model.model:
        quant_format = hook.fw_detect_quant_format(model_path=config.model.model, hf_config=hf_config)
    if hf_config is not None:
        quant = hf_config.get("quantization_config") or {}
        quant_format = quant_format or quant.get("quant_method")
        if quant_format == "compressed-tensors" and not quant.get("config_groups"):
            quant_format = None  # plain weights: llm-compressor's KV-cache-only recipes quantize no layer
        dtype = dtype or hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        heads = hf_config.get("num_attention_heads")
        head_size = hf_config.get("head_dim") or (hf_config["hidden_size"] // heads if heads else None)
        if hf_config.get("sliding_window") and hf_config.get("use_sliding_window", True):
            features.add("sliding_window")
        if "kv_lora_rank" in hf_config:
            features.add("mla")
            # The query/key head (AttentionLayerSpec.head_size); config.json's head_dim is the rotary part.
            head_size = hf_config.get("qk_nope_head_dim", 0) + hf_config.get("qk_rope_head_dim", 0) or head_size
            mla_dims = (hf_config["kv_lora_rank"], hf_config.get("qk_rope_head_dim", 0))
        if hf_config.get("attn_logit_softcapping"):
            features.add("soft_cap")
        arch = (hf_config.get("architectures") or [None])[0]
    return Requirements(
        device=device.device,
        compute_capability=device.compute_capability,
        num_devices=max(device.count, 1) if device.device == "cuda" else 1,
        dtype=_cpu_dtype(dtype, device.device) if dtype else None,
        head_size=head_size,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        block_size=config.cache.block_size,
        attention_features=frozenset(features),
        mla_dims=mla_dims,
        quant_format=quant_format,
        architecture=arch,
    )


def _installed(kind: str) -> list[PluginSpec]:
    return list({s.name: s for s in plugins.available(kind).values()}.values())


def _fits(kind: str, req: Requirements) -> list[PluginSpec]:
    """The plugins that can run ``req``, highest priority first (by name within a priority, for display only)."""
    fitting = (s for s in _installed(kind) if not s.capabilities.problems(req))
    return sorted(fitting, key=lambda s: (-s.priority, s.name))


def checkpoint_format(model_path: str) -> PluginSpec:
    """The format that reads ``model_path``: the highest-priority format plugin claiming its suffix, else, for a
    directory with config.json, the core's. A path neither claims is a ModelError saying why; a tie at the top
    priority is a PluginError naming the tied formats, never broken by name."""
    claiming = [s for s in _installed("checkpoint_format") if s.capabilities.claims(model_path)]
    if not claiming:
        if (Path(model_path) / "config.json").is_file():
            return DIRECTORY_FORMAT
        raise ModelError(_unclaimed(Path(model_path)))
    top, *tied = plugins.by_priority(claiming)[0]
    if tied:
        names = ", ".join(s.name for s in (top, *tied))
        raise PluginError(
            f"checkpoint formats {names} all claim {model_path} at priority {top.priority}; "
            "disable all but one (FW_DISABLE_PLUGINS=checkpoint_format:NAME)"
        )
    return top


def _unclaimed(path: Path) -> str:
    if not path.exists():
        return f"model path {path} does not exist"
    if path.is_dir():
        return f"{path} has no config.json"
    return (
        f"{path} is a file that no installed checkpoint format reads (`fw plugins list --kind checkpoint_format` "
        "lists the suffixes they claim); a model directory holds config.json and safetensors"
    )


def _resolve_format(model_path: str, result: CheckResult) -> None:
    try:
        spec = result.selected["checkpoint_format"] = checkpoint_format(model_path)
    except (ModelError, PluginError) as exc:
        result.problems.append(str(exc))
        return
    suffixes = ", ".join(sorted(spec.capabilities.suffixes))
    result.reasons["checkpoint_format"] = f"claims paths ending {suffixes}" if suffixes else "the core's: no format plugin claims it"


def _resolve_auto(kind: str, req: Requirements, result: CheckResult) -> None:
    """The highest-priority plugin that fits and imports; a tie at that priority is refused, never broken by name."""
    fitting = _fits(kind, req)
    unfit = [f"{s.name}: {'; '.join(s.capabilities.problems(req))}" for s in _installed(kind) if s not in fitting]
    broken = []
    for group in plugins.by_priority(fitting):
        usable = []
        for spec in group:
            problem = plugins.impl_problem(spec)
            if problem:
                broken.append(problem)
            else:
                usable.append(spec)
        if len(usable) > 1:
            result.problems.append(
                f"auto cannot choose between {kind} plugins {', '.join(s.name for s in usable)}: they fit at the same "
                f"priority ({usable[0].priority}); choose one with --{kind.replace('_', '-')} NAME"
            )
        elif usable:
            chosen = usable[0]
            others = [f"{s.name} ({s.priority})" for s in fitting if s is not chosen]
            result.selected[kind] = chosen
            result.reasons[kind] = (
                f"auto: the highest priority ({chosen.priority}) of the plugins that fit"
                + (f"; also fit: {', '.join(others)}" if others else "")
                + (f"; cannot run this: {' | '.join(unfit)}" if unfit else "")
            )
        if usable:
            break
    else:
        result.problems.append(f"no {kind} plugin can run this ({' | '.join(unfit + broken) or 'none installed'})")
    result.broken.extend(broken)


def _resolve_slot(kind: str, name: str, req: Requirements, result: CheckResult) -> None:
    if name == "auto":
        _resolve_auto(kind, req, result)
    else:
        try:
            spec = plugins.get_spec(kind, name)
        except PluginError as exc:
            result.problems.append(str(exc))
        else:
            result.selected[kind] = spec
            result.reasons[kind] = "chosen by name"
            problems = spec.capabilities.problems(req)
            result.problems.extend(f"{kind} plugin {name!r} {p}" for p in problems)
            broken = None if problems else plugins.impl_problem(spec)
            if broken:
                result.problems.append(broken)
    if kind not in result.selected or result.selected[kind].capabilities.problems(req):
        result.alternatives[kind] = [s.name for s in _fits(kind, req)]


def check(
    config: FwConfig,
    device: DeviceInfo | None = None,
    hf_config: dict[str, Any] | None = None,
) -> CheckResult:
    """Resolve every slot of ``config`` and collect every reason the run cannot work."""
    device = device or detect(config.model.device)
    req = model_requirements(config, device, hf_config)
    result = CheckResult(req)
    if hf_config is not None:
        try:
            model = result.selected["models"] = model_registry.resolve(hf_config)
        except ModelError as exc:
            result.problems.append(str(exc))
        else:
            needed = req.attention_features | model.capabilities.requires_attention_features
            req = result.requirements = replace(req, attention_features=needed)
        if config.model.model:
            _resolve_format(config.model.model, result)
    for kind in SLOTS:
        choice = config.plugin_choice(kind)
        if choice.name is None:
            continue
        _resolve_slot(kind, choice.name, req, result)
        spec = result.selected.get(kind)
        if spec is not None:
            try:
                result.options[kind] = spec.parse_options(choice.options)
            except (ValidationError, PluginError) as exc:
                result.problems.append(f"{kind}.options: {_short(exc)}")
    _check_cross_slot(req, result)
    _resolve_proposer(config, result)
    result.problems.extend(_parser_problems(config))
    result.problems.extend(_not_implemented(config))
    result.problems.extend(_ray_problems(config, req))
    result.problems.extend(_expert_parallel_problems(config, hf_config))
    result.problems.extend(_pipeline_parallel_problems(config, hf_config, result.selected.get("models")))
    for extra in plugins.get_plugin_manager().hook.fw_validate(config=config, requirements=req):
        result.problems.extend(extra or [])
    return result


def _resolve_proposer(config: FwConfig, result: CheckResult) -> None:
    """The speculative-decoding proposer that ``speculative_config.method`` names, and its options."""
    spec_config = config.speculative_config
    if spec_config is None:
        return
    try:
        spec = plugins.get_spec("spec_proposers", spec_config.method)
    except PluginError as exc:
        result.problems.append(f"speculative_config.method: {exc}")
        return
    problem = plugins.impl_problem(spec)
    if problem:
        result.problems.append(problem)
        return
    result.selected["spec_proposers"] = spec
    result.reasons["spec_proposers"] = "speculative_config.method"
    try:
        result.options["spec_proposers"] = spec.parse_options(spec_config.proposer_options())
    except (ValidationError, PluginError) as exc:
        result.problems.append(f"speculative_config ({spec.name} options): {_short(exc)}")


def _parser_problems(config: FwConfig) -> list[str]:
    """The chat section's parsers must exist (and import), and auto tool choice needs a tool parser."""
    chat, problems = config.chat, []
    for kind, flag, name in (("tool_parsers", "--tool-call-parser", chat.tool_call_parser),
                             ("reasoning_parsers", "--reasoning-parser", chat.reasoning_parser)):
        if name is not None:
            try:
                plugins.load_parser(kind, name)
            except PluginError as exc:
                problems.append(f"{flag}: {exc}")
    if chat.enable_auto_tool_choice and chat.tool_call_parser is None:
        problems.append("--enable-auto-tool-choice needs --tool-call-parser to read the model's calls")
    return problems


def _ray_problems(config: FwConfig, req: Requirements) -> list[str]:
    if config.parallel.distributed_executor_backend != "ray":
        return []
    problems = []
    if importlib.util.find_spec("ray") is None:
        problems.append("--distributed-executor-backend ray needs the ray package (pip install ray)")
    if req.device == "cuda":
        # Rank 0 runs in the engine process, outside Ray's GPU accounting: a worker could be given its GPU.
        problems.append("--distributed-executor-backend ray on CUDA is not implemented yet (use mp on one machine)")
    return problems


def _not_implemented(config: FwConfig) -> list[str]:
    """Settings the configuration holds for later work: refused, never accepted and ignored."""
    parallel, connector = config.parallel, config.kv_connector.name
    refused = [
        # Each replica is a one-process engine; replicas of several processes are not.
        (parallel.data_parallel_size > 1
         and (parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1),
         f"--data-parallel-size (-dp) {parallel.data_parallel_size} with tensor or pipeline parallelism: "
         "replicas of several processes each"),
        (parallel.data_parallel_size > 1 and connector is not None,
         f"--data-parallel-size (-dp) {parallel.data_parallel_size} with --kv-connector {connector}: "
         "a connector per replica"),
        # The engine reads the connector's transfer reports from rank 0 alone.
        (connector is not None and parallel.tensor_parallel_size > 1,
         f"--kv-connector {connector} with --tensor-parallel-size {parallel.tensor_parallel_size}: "
         "a KV connector across tensor-parallel ranks"),
        (connector is not None and parallel.pipeline_parallel_size > 1,
         f"--kv-connector {connector} with --pipeline-parallel-size {parallel.pipeline_parallel_size}: "
         "a KV connector across pipeline stages"),
        # A verification step writes KV for drafts it may reject: the connector would send or save it.
        (connector is not None and config.speculative_config is not None,
         f"--kv-connector {connector} with speculative_config (speculative decoding)"),
    ]
    return [f"{what} is not implemented yet" for given, what in refused if given]


def _pipeline_parallel_problems(
    config: FwConfig, hf_config: dict[str, Any] | None, model: PluginSpec | None
) -> list[str]:
    stages = config.parallel.pipeline_parallel_size
    layers = hf_config.get("num_hidden_layers", 0) if hf_config is not None else None
    partition = config.parallel.pp_layer_partition
    if partition is not None:
        wrong = [
            (len(partition) != stages, f"{len(partition)} counts for --pipeline-parallel-size {stages}"),
            (any(n < 1 for n in partition), "a stage without layers"),
            (layers is not None and sum(partition) != layers, f"they sum to {sum(partition)}, not {layers}"),
        ]
        if any(given for given, _ in wrong):
            total = f"the model's {layers} layers" if layers is not None else "the model's layer count"
            return [
                f"parallel.pp_layer_partition (--pp-layer-partition, FW_PP_LAYER_PARTITION) "
                f"{','.join(map(str, partition))}: {'; '.join(reason for given, reason in wrong if given)}; give "
                f"one positive layer count per pipeline stage, comma-separated, summing to {total}"
            ]
    if stages == 1 or hf_config is None:
        return []
    if model is not None and "pipeline_parallel" not in model.capabilities.features:
        return [f"--pipeline-parallel-size {stages}: model plugin {model.name!r} does not declare pipeline_parallel"]
    if layers < stages:
        return [f"--pipeline-parallel-size {stages}: more stages than the model's {layers} layers"]
    return []


def _expert_parallel_problems(config: FwConfig, hf_config: dict[str, Any] | None) -> list[str]:
    parallel = config.parallel
    if not parallel.enable_expert_parallel:
        return []
    ranks = parallel.tensor_parallel_size * parallel.data_parallel_size  # the EP group spans TP x DP
    if ranks == 1:
        return [
            "--enable-expert-parallel needs more than one rank to shard experts over "
            "(--tensor-parallel-size 1, --data-parallel-size 1)"
        ]
    if hf_config is None:
        return []
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts")
    if not experts:
        return ["--enable-expert-parallel: the model has no routed experts"]
    if experts % ranks:
        return [f"--enable-expert-parallel: {experts} experts do not split evenly over {ranks} ranks"]
    return []


def _check_cross_slot(req: Requirements, result: CheckResult) -> None:
    quant, attn = result.selected.get("quant"), result.selected.get("attention")
    if quant is None or attn is None:
        return
    needed = quant.capabilities.requires_attention_features - attn.capabilities.provided_features
    if needed:
        result.problems.append(
            f"quant plugin {quant.name!r} needs attention feature(s) {', '.join(sorted(needed))}, "
            f"which attention plugin {attn.name!r} lacks"
        )
        needy = replace(req, attention_features=req.attention_features | quant.capabilities.requires_attention_features)
        result.alternatives["attention"] = [s.name for s in _fits("attention", needy)]


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return str(exc)


@dataclass
class ModelCheck:
    """``check`` for a model path: the resolved path, its config and the checkpoint format that read it."""

    result: CheckResult
    model_path: str | None
    hf_config: dict[str, Any] | None
    format: CheckpointFormat | None = None  # reads the weights and (maybe) the tokenizer; None when no format reads it


def check_model(config: FwConfig, device: DeviceInfo | None = None) -> ModelCheck:
    """Find the model (the configured path, else a plugin's default), read its config, check everything.

    The path's checkpoint format reads the config: a path that no format reads, or a config that its format cannot
    read (a directory's config.json that is not JSON, a GGUF file of an architecture fw does not implement), is a
    problem, reported like the others.
    """
    device = device or detect(config.model.device)
    path = config.model.model or plugins.get_plugin_manager().hook.fw_default_model()
    if path is None:
        result = CheckResult(model_requirements(config, device, None))
        result.problems.append("no model given (--model PATH) and no installed plugin provides a default model")
        return ModelCheck(result, None, None)
    config.model.model = str(path)
    try:
        reader = checkpoint_format(config.model.model).load()()
        hf_config = reader.config(config.model.model)
    except (ModelError, PluginError) as exc:
        result = check(config, device)
        result.problems.insert(0, str(exc))
        return ModelCheck(result, config.model.model, None)
    return ModelCheck(check(config, device, hf_config), config.model.model, hf_config, reader)
