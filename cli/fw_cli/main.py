"""The ``fw`` command."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from fw import __version__, plugins
from fw.config import ResolvedConfig, show
from fw_cli.bench import bench
from fw_cli.options import config_options


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="fw")
def cli() -> None:
    """Flywheel: a plugin-based LLM inference engine."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)


# --- fw plugins ------------------------------------------------------------


@cli.group("plugins")
def plugins_group() -> None:
    """List, inspect and check plugins."""


def _caps_summary(spec: plugins.PluginSpec) -> str:
    described = spec.capabilities.describe()
    parts = []
    for key, value in described.items():
        if key == "features" and not value:
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        parts.append(f"{key}={shown}")
    return " ".join(parts)


def _all_discovered(kind: str | None) -> list[plugins.Discovered]:
    kinds = [kind] if kind else [*plugins.KINDS, "hooks"]
    out: list[plugins.Discovered] = []
    for k in kinds:
        out.extend(plugins.discover_hooks() if k == "hooks" else plugins.discover(k))
    return out


@plugins_group.command("list")
@click.option("--kind", type=click.Choice([*plugins.KINDS, "hooks"]), help="Only this kind.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_list(kind: str | None, as_json: bool) -> None:
    """Every installed plugin by kind: name, version, distribution, status, capabilities."""
    found = _all_discovered(kind)
    if as_json:
        rows = [
            {
                "kind": d.kind,
                "name": d.name,
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
        click.echo(f"  {d.name:<14} {d.status:<8} {dist:<32} {detail}")
    for d in found:
        if d.error and d.enabled:
            click.echo(f"warning: {d.kind} plugin {d.name!r} ({d.target}) is broken: {d.error}", err=True)


@plugins_group.command("show")
@click.argument("name")
@click.option("--kind", type=click.Choice([*plugins.KINDS, "hooks"]), help="Disambiguate a name used by several kinds.")
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
            if d.spec.aliases:
                click.echo(f"  aliases:      {', '.join(d.spec.aliases)}")
            for key, value in d.spec.capabilities.describe().items():
                click.echo(f"  {key}: {value}")
            if d.spec.options is not None:
                schema = d.spec.options.model_json_schema().get("properties", {})
                click.echo("  options:")
                for opt, info in schema.items():
                    click.echo(f"    {opt}: {info.get('type', '')} (default {info.get('default')!r}) {info.get('description', '')}")


@plugins_group.command("check")
@config_options()
def plugins_check(resolved: ResolvedConfig) -> None:
    """Check that the chosen plugins can run the model on the device; list every problem."""
    from fw.validate import check, check_model

    config = resolved.config
    plugins.configure(config)
    # Without --model only the plugins are checked; with it, the model's needs too.
    result = check_model(config).result if config.model.model else check(config)
    if not result.ok:
        click.echo(result.report(), err=True)
        sys.exit(1)
    click.echo(f"ok: device={result.requirements.device}")
    for kind, spec in result.selected.items():
        click.echo(f"  {kind}: {spec.name}")


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
    from fw.model_registry import ModelError
    from fw.sampling_params import SamplingParams

    try:
        engine = LLMEngine(resolved.config)
    except (EngineError, ModelError, plugins.PluginError) as exc:
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
    from fw.async_engine import AsyncEngine
    from fw.engine import EngineError, LLMEngine
    from fw.generation_config import sampling_defaults
    from fw.model_loader import ModelLoadError
    from fw_cli.server.app import Server, run

    config = resolved.config
    try:
        engine = LLMEngine(config)
    except (EngineError, ModelLoadError, plugins.PluginError) as exc:
        raise click.ClickException(str(exc)) from None
    model = config.model.model
    name = config.server.served_model_name or (Path(model).stem if Path(model).is_file() else model)
    defaults = sampling_defaults(config.model)
    server = Server(AsyncEngine(engine), name, config.server, defaults)
    host, port = config.server.host, config.server.port
    click.echo(f"fw serve: model {name!r} ({model}), max_model_len {engine.max_model_len}", err=True)
    if defaults:
        click.echo(f"fw serve: sampling defaults from the model's generation config: {defaults} "
                   "(--generation-config vllm ignores them)", err=True)
    click.echo(f"fw serve: listening on http://{host}:{port}/v1", err=True)
    run(server, host, port, config.server.uvicorn_log_level)


cli.add_command(bench)


def main() -> None:
    cli(prog_name="fw")
