"""A deliberately broken hooks plugin (see broken_plugins.py): its returns break two hooks' contracts."""

from fw.interfaces.hooks import CliOption, hookimpl


@hookimpl
def fw_cli_options():
    return [CliOption("--broken-level", "broken.level", "Sets a section that does not exist.")]


@hookimpl
def fw_validate(config, requirements):
    return "a string, where a list of reasons is due"
