"""pluggy hook specifications: Flywheel's control plane.

A hooks plugin is a module (or object) with functions named like these,
decorated with ``fw.hookimpl``, registered under the ``fw.hooks`` entry-point
group. An implementation may accept any subset of a hook's arguments, so new
arguments never break existing plugins. None of these hooks runs per layer or
per token: the hot path calls drivers directly.

Order of calls in a run: ``fw_config_sections`` and ``fw_cli_options`` while
the configuration is assembled; ``fw_configure`` once it is final;
``fw_detect_quant_format`` and ``fw_validate`` while plugins are resolved;
``fw_engine_started``; then per request ``fw_request_added`` /
``fw_logits_processors`` / ``fw_request_finished`` and per engine step
``fw_step_stats``; finally ``fw_unconfigure`` at shutdown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable

    from fw.config import CliOption, FwConfig
    from fw.interfaces.base import Requirements
    from fw.sampling_params import SamplingParams

PROJECT = "fw"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def fw_config_sections() -> dict[str, type]:
    """Contribute top-level configuration sections: ``{name: pydantic model}``.

    Each section is validated by its model and appears in ``fw config show``,
    in config files and as ``FW_<NAME>__<FIELD>`` environment variables.
    """


@hookspec
def fw_cli_options() -> list[CliOption]:
    """Contribute command-line flags, each mapped onto a configuration path."""


@hookspec(historic=True)
def fw_configure(config: FwConfig) -> None:
    """Start-up: the effective configuration is final. Called once per process."""


@hookspec
def fw_unconfigure(config: FwConfig) -> None:
    """Shutdown: release whatever ``fw_configure`` acquired."""


@hookspec(firstresult=True)
def fw_detect_quant_format(model_path: str, hf_config: dict[str, Any] | None) -> str | None:
    """Name the checkpoint's quantization format (e.g. "gguf"), or None to pass."""


@hookspec(firstresult=True)
def fw_default_model() -> str | None:
    """The model to run when none is given (e.g. one a package ships), or None to pass."""


@hookspec
def fw_validate(config: FwConfig, requirements: Requirements) -> list[str]:
    """Return reasons this run cannot work (empty when fine); all are reported together."""


@hookspec
def fw_engine_started(engine: Any) -> None:
    """The engine is built (model loaded, KV cache allocated) and about to take requests."""


@hookspec
def fw_request_added(request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
    """A request was admitted to the waiting queue."""


@hookspec
def fw_logits_processors(request_id: str, sampling_params: SamplingParams) -> list[Callable[[list[int], Any], Any]]:
    """Per-request logits processors: ``f(output_token_ids, logits[V]) -> logits[V]``, applied before sampling."""


@hookspec
def fw_request_finished(request_id: str, output: Any) -> None:
    """A request finished (stopped, hit a length limit, or was aborted); ``output`` is its final output."""


@hookspec
def fw_step_stats(stats: Any) -> None:
    """Once per engine step, with the step's ``fw.engine.StepStats``."""
