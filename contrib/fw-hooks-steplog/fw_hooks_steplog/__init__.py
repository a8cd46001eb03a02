"""Step log: one JSON line per engine step (``fw.interfaces.hooks.StepStats``), an example hooks plugin to copy.

It adds a config section, ``steplog: {path: ...}``, and the flag ``--steplog PATH`` (``LLM(steplog=PATH)``);
without a path it does nothing. Each engine writes to the path its own configuration names: the file is
opened in ``fw_configure`` and closed in ``fw_unconfigure``, and held per configuration in between, so two
engines in one process never share one. Light on purpose: fw imports every hooks plugin when it starts.
"""

from __future__ import annotations

import dataclasses
import json
from typing import IO

from pydantic import BaseModel, Field

from fw.interfaces.hooks import CliOption, EngineView, FwConfig, StepStats, hookimpl


class StepLogSection(BaseModel, extra="forbid"):
    path: str | None = Field(None, description="Append one JSON line per engine step to this file.")


# id(config) -> that engine's open log
_logs: dict[int, IO[str]] = {}


@hookimpl
def fw_config_sections() -> dict[str, type]:
    return {"steplog": StepLogSection}


@hookimpl
def fw_cli_options() -> list[CliOption]:
    return [CliOption("--steplog", "steplog.path", StepLogSection.model_fields["path"].description)]


@hookimpl
def fw_configure(config: FwConfig) -> None:
    if config.steplog.path:
        _logs[id(config)] = open(config.steplog.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in fw_unconfigure)


@hookimpl
def fw_step_stats(stats: StepStats, engine: EngineView) -> None:
    log = _logs.get(id(engine.config))
    if log is not None:
        log.write(json.dumps(dataclasses.asdict(stats)) + "\n")
        log.flush()


@hookimpl
def fw_unconfigure(config: FwConfig) -> None:
    log = _logs.pop(id(config), None)
    if log is not None:
        log.close()
