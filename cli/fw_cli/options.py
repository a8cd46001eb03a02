"""Click options generated from the configuration tree, shared by every command."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from fw.config import (
    ENGINE_SECTIONS,
    SERVER_SECTIONS,
    CliOption,
    ConfigError,
    cli_options,
    load_config,
    parse_plugin_options,
    set_path,
)


def _dest(path: str) -> str:
    return "cfg__" + path.replace(".", "__")


def _click_option(opt: CliOption) -> Callable:
    names = [opt.flag, *opt.aliases]
    if opt.is_flag:
        base = opt.flag[2:]
        return click.option(f"{opt.flag}/--no-{base}", _dest(opt.path), default=None, help=opt.help)
    kind = click.Choice(opt.choices) if opt.choices else None
    return click.option(*names, _dest(opt.path), type=kind, default=None, help=opt.help)


def _refuse_remote_code(_ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        raise click.UsageError(
            "--trust-remote-code: fw runs no code from model repositories; it serves the architectures built in "
            "or added by plugins (`fw plugins list`), so drop the flag"
        )


def config_options(server: bool = False, model_argument: bool = False) -> Callable:
    """Add ``--config``, ``--plugin-option`` and one flag per configuration field; pass ``resolved``.

    ``model_argument``: also take the model as an optional positional MODEL, as ``vllm serve MODEL`` does.
    """
    options = cli_options(ENGINE_SECTIONS) + (cli_options(SERVER_SECTIONS) if server else [])
    by_dest = {_dest(o.path): o for o in options}

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, config_files: tuple[str, ...], plugin_option: tuple[str, ...], **kwargs: Any):
            cli: dict[str, Any] = {}
            flags: dict[str, str] = {}
            for dest in list(kwargs):
                if dest in by_dest:
                    value = kwargs.pop(dest)
                    if value is not None:
                        set_path(cli, by_dest[dest].path, value)
                        flags[by_dest[dest].path] = by_dest[dest].flag
            positional = kwargs.pop("model_positional", None)
            if positional is not None:
                flag_value = cli.get("model", {}).get("model")
                if flag_value not in (None, positional):
                    raise click.UsageError(f"MODEL {positional!r} and --model {flag_value!r} differ; give the model once")
                set_path(cli, "model.model", positional)
                flags.setdefault("model.model", "MODEL")
            try:
                for field, values in parse_plugin_options(list(plugin_option)).items():
                    for name, value in values["options"].items():
                        path = f"{field}.options.{name}"
                        set_path(cli, path, value)
                        flags[path] = "--plugin-option"
                resolved = load_config(config_files, cli, flags)
            except ConfigError as exc:
                raise click.UsageError(str(exc)) from None
            return func(*args, resolved=resolved, **kwargs)

        for opt in reversed(options):
            wrapper = _click_option(opt)(wrapper)
        wrapper = click.option(
            "--plugin-option",
            multiple=True,
            metavar="KIND.OPTION=VALUE",
            help="Set a plugin option, e.g. sampler.mass=0.9 or quant.skip=[o_proj] "
            "(KIND: attention, quant, comm, kv_connector, sampler).",
        )(wrapper)
        wrapper = click.option(
            "--trust-remote-code",
            is_flag=True,
            expose_value=False,
            callback=_refuse_remote_code,
            help="Refused: fw runs no code from model repositories (vLLM's flag, named here to say so).",
        )(wrapper)
        if model_argument:
            wrapper = click.argument("model_positional", metavar="[MODEL]", required=False)(wrapper)
        wrapper = click.option(
            "--config",
            "config_files",
            multiple=True,
            type=click.Path(),
            help="YAML or TOML config file; repeat to layer several (later wins).",
        )(wrapper)
        return wrapper

    return decorate
