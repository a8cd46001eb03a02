"""The ``fw`` command."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from fw import __version__, plugins
from fw.config import ResolvedConfig, show
from fw.interfaces.spec import KIND_ALIASES, PluginError, PluginSpec, canonical_kind
from fw_cli.bench import bench
from fw_cli.options import config_options


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="fw")
def cli() -> None:
    """Flywheel: a plugin-based LLM inference engine."""
    # FW_LOG_LEVEL=DEBUG shows what INFO summarizes (each kernel choice's timings, fw.sdk.kernels).
    logging.basicConfig(level=os.environ.get("FW_LOG_LEVEL", "INFO").upper(), format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)


# --- fw plugins ------------------------------------------------------------


@cli.group("plugins")
def plugins_group() -> None:
    """List, inspect and check plugins."""


def _caps_summary(spec: PluginSpec) -> str:
    described = spec.capabilities.describe()
    parts = []
    for key, value in described.items():
        if key == "features" and not value:
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        parts.append(f"{key}={shown}")
    return " ".join(parts)


def _all_discovered(kind: str | None) -> list[plugins.Discovered]:
    kinds = [canonical_kind(kind)] if kind else [*plugins.KINDS, "hooks"]
    out: list[plugins.Discovered] = []
    for k in kinds:
        out.extend(plugins.discover_hooks() if k == "hooks" else plugins.discover(k))
    return out


def _option_rows(model: type) -> list[dict[str, object]]:
    """Each option of a plugin's options model: its type, allowed values, default and description."""
    from typing import Literal, get_args, get_origin

    rows = []
    for name, info in model.model_fields.items():
        annotation, allowed = info.annotation, []
        if get_origin(annotation) is Literal:
            allowed = [repr(v) for v in get_args(annotation)]
            type_name = type(get_args(annotation)[0]).__name__
        else:
            type_name = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
        for constraint in info.metadata:  # Field(gt=0, le=1) -> annotated_types.Gt(0), Le(1)
            for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if getattr(constraint, attr, None) is not None:
                    allowed.append(f"{op} {getattr(constraint, attr)}")
        default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
        rows.append({"name": name, "type": type_name, "allowed": allowed, "default": default,
                     "description": info.description or ""})
    return rows


KIND_CHOICE = click.Choice([*plugins.KINDS, "hooks", *KIND_ALIASES])


@plugins_group.command("list")
@click.option("--kind", type=KIND_CHOICE, help="Only this kind.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_list(kind: str | None, as_json: bool) -> None:
    """Every installed plugin by kind: name, priority, version, distribution, status, capabilities.

    "auto" takes the plugin of highest priority that can run the model (`fw plugins check` says why)."""
    found = _all_discovered(kind)
    if as_json:
        rows = [
            {
                "kind": d.kind,
                "name": d.name,
                "priority": d.spec.priority if d.spec else None,
                "distribution": d.distribution,
                "version": d.version,
                "status": d.status,
                "error": d.error,
                "capabilities": d.spec.capabilities.describe() if d.spec else None,
            }
            for d in found
        ]
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    current = None
    for d in found:
        if d.kind != current:
            current = d.kind
            click.echo(f"{d.kind}:")
        dist = f"{d.distribution} {d.version}" if d.distribution else "(no distribution)"
        detail = _caps_summary(d.spec) if d.spec else (d.error or "")
        priority = f"priority={d.spec.priority}" if d.spec else ""
        click.echo(f"  {d.name:<14} {d.status:<8} {priority:<12} {dist:<32} {detail}")
    for d in found:
        if d.error and d.enabled:
            click.echo(f"warning: {d.label} is broken: {d.error}", err=True)


@plugins_group.command("show")
@click.argument("name")
@click.option("--kind", type=KIND_CHOICE, help="Disambiguate a name used by several kinds.")
def plugins_show(name: str, kind: str | None) -> None:
    """Everything known about one plugin."""
    matches = [d for d in _all_discovered(kind) if d.name == name or (d.spec and name in d.spec.aliases)]
    if not matches:
        names = sorted({d.name for d in _all_discovered(kind)})
        raise click.UsageError(f"no plugin named {name!r} (installed: {', '.join(names)})")
    for d in matches:
        click.echo(f"{d.kind} plugin {d.name}")
        click.echo(f"  distribution: {d.distribution or '-'} {d.version or ''}")
        click.echo(f"  entry point:  fw.{d.kind} = {d.target}")
        click.echo(f"  status:       {d.status}" + (f" ({d.error})" if d.error else ""))
        if d.spec:
            click.echo(f"  description:  {d.spec.description}")
            click.echo(f"  implementation: {d.spec.impl}")
            click.echo(f"  api version:  {d.spec.api_version}")
            click.echo(f"  priority:     {d.spec.priority} (auto takes the highest-priority plugin that fits)")
            if d.spec.aliases:
                click.echo(f"  aliases:      {', '.join(d.spec.aliases)}")
            for key, value in d.spec.capabilities.describe().items():
                click.echo(f"  {key}: {value}")
            if d.spec.options is not None:
                click.echo(f"  options (--plugin-option {d.kind}.NAME=VALUE; lists and mappings as JSON or YAML):")
                for row in _option_rows(d.spec.options):
                    allowed = f", allowed {' '.join(row['allowed'])}" if row["allowed"] else ""
                    click.echo(f"    {row['name']}: {row['type']}{allowed}, default {row['default']}. {row['description']}")


@plugins_group.command("check")
@config_options()
def plugins_check(resolved: ResolvedConfig) -> None:
    """Check that the chosen plugins can run the model on the device; list every problem.

    Without --model, the default model (one an installed plugin provides) is checked, as `fw generate` would
    run it; with neither, only the plugins. Says which model it checked and why "auto" chose each plugin.
    """
    from fw.validate import check, check_model

    config = resolved.config
    plugins.configure(config)
    given = config.model.model
    if given or plugins.get_plugin_manager().hook.fw_default_model():
        result = check_model(config).result  # takes the default model when none is given
        model = f"model: {config.model.model}" + ("" if given else " (the default model: no --model given)")
    else:
        result = check(config)
        model = "model: none given and no default model installed; checked the plugins only"
    out = sys.stdout if result.ok else sys.stderr
    click.echo(model, file=out)
    for line in result.broken:
        click.echo(f"passed over: {line}", file=out)
    if not result.ok:
        click.echo(result.report(), err=True)
        sys.exit(1)
    click.echo(f"ok: device={result.requirements.device}")
    for kind, spec in result.selected.items():
        reason = result.reasons.get(kind)
        click.echo(f"  {kind}: {spec.name}" + (f"  ({reason})" if reason else ""))


# --- fw config -------------------------------------------------------------


@cli.group("config")
def config_group() -> None:
    """Inspect the effective configuration."""


@config_group.command("show")
@config_options(server=True)
def config_show(resolved: ResolvedConfig) -> None:
    """Print the merged configuration with the source of every value."""
    click.echo(show(resolved))


# --- fw generate -------------------------------------------------------------


@cli.command("generate")
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text; repeat for a batch.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=-1), default=0, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@config_options()
def generate(resolved: ResolvedConfig, prompts, max_tokens, temperature, top_p, top_k, ignore_eos) -> None:
    """Generate completions offline and print them."""
    from fw.engine import EngineError, LLMEngine
    from fw.sdk.errors import ModelError
    from fw.sdk.sampling_params import SamplingParams

    try:
        engine = LLMEngine(resolved.config)
    except (EngineError, ModelError, PluginError) as exc:
        raise click.ClickException(str(exc)) from None
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, ignore_eos=ignore_eos
    )
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    except EngineError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        engine.shutdown()
    for prompt, rid in zip(prompts, ids, strict=True):
        out = done[rid].outputs[0]
        click.echo(f"{prompt}{out.text}")
        click.echo(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", err=True)


# --- fw serve ----------------------------------------------------------------


@cli.command("serve")
@config_options(server=True, model_argument=True)
def serve(resolved: ResolvedConfig) -> None:
    """Serve the OpenAI API (completions, chat, models, tokenize, metrics) for one model.

    MODEL is the model path, as --model (vLLM's `vllm serve MODEL`).
    """
    from fw.data_parallel import DataParallelEngine
    from fw.engine import EngineError, LLMEngine
    from fw.engine.async_engine import AsyncEngine
    from fw.generation_config import sampling_defaults
    from fw.sdk.errors import ModelLoadError
    from fw_cli.server.app import Server, run

    config = resolved.config
    replicas = config.parallel.data_parallel_size
    # Native kernels not built on this machine yet build while the server answers on the torch path (fw.sdk.native).
    os.environ.setdefault("FW_NATIVE_BUILD", "background")
    try:
        engine = DataParallelEngine(config) if replicas > 1 else AsyncEngine(lambda: LLMEngine(config))
    except (EngineError, ModelLoadError, PluginError) as exc:
        raise click.ClickException(str(exc)) from None
    model = config.model.model
    name = config.server.served_model_name or (Path(model).stem if Path(model).is_file() else model)
    defaults = sampling_defaults(config.model)
    server = Server(engine, name, config.server, defaults)
    host, port = config.server.host, config.server.port
    click.echo(f"fw serve: model {name!r} ({model}), max_model_len {engine.view.max_model_len}"
               + (f", {replicas} data-parallel replicas" if replicas > 1 else ""), err=True)
    if defaults:
        click.echo(f"fw serve: sampling defaults from the model's generation config: {defaults} "
                   "(--generation-config vllm ignores them)", err=True)
    if resolved.source("server.api_key") == "--api-key":
        click.echo("fw serve: warning: --api-key shows in `ps`; prefer FW_SERVER__API_KEY or --api-key-file", err=True)
    click.echo(f"fw serve: listening on http://{host}:{port}/v1", err=True)
    run(server, host, port, config.server.uvicorn_log_level)


@cli.command("router")
@click.option("--prefill", multiple=True, metavar="URL",
              help="A prefill instance: fw serve with a KV connector in the producer role. Repeat for several.")
@click.option("--decode", multiple=True, required=True, metavar="URL",
              help="A decode instance: fw serve with a KV connector in the consumer role. Repeat for several.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--health-interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between health checks of the instances.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds an instance may take to answer.")
def router(prefill, decode, host, port, health_interval, timeout) -> None:
    """Disaggregated prefill/decode behind one OpenAI-compatible endpoint.

    Each request is prefilled on a --prefill instance, then decoded on a --decode instance that loads the
    prompt's KV through its connector (round-robin over healthy instances; see fw_cli/router.py).
    """
    import uvicorn

    from fw_cli.router import Router, build_app

    for flag, urls in (("--prefill", prefill), ("--decode", decode)):
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise click.BadParameter(f"expected an http:// or https:// URL, got {url!r}", param_hint=flag)
    click.echo(f"fw router: prefill {list(prefill)}, decode {list(decode)}; listening on http://{host}:{port}/v1",
               err=True)
    uvicorn.run(build_app(Router(list(prefill), list(decode), timeout, health_interval)), host=host, port=port,
                log_level="warning")


cli.add_command(bench)


def main() -> None:
    cli(prog_name="fw")
