"""pluggy hook specifications: Flywheel's control plane.

A hooks plugin is a module (or object) with functions named like these,
decorated with ``fw.interfaces.hooks.hookimpl``, registered under the ``fw.hooks`` entry-point
group. An implementation may accept any subset of a hook's arguments, so new
arguments never break existing plugins. None of these hooks runs per layer or
per token: the hot path calls drivers directly.

Order of calls for each engine (``LLM()``, ``fw generate``, ``fw serve``):
``fw_config_sections`` and ``fw_cli_options`` while the configuration is
assembled; ``fw_configure`` once it is final; ``fw_detect_quant_format`` and
``fw_validate`` while plugins are resolved; ``fw_engine_started``; then per
request ``fw_request_added`` / ``fw_logits_processors`` /
``fw_request_finished`` and per engine step ``fw_step_stats``; finally
``fw_unconfigure`` at shutdown. A process may run several engines, one after
the other or side by side: each gets its own ``fw_configure`` /
``fw_unconfigure`` pair, and the per-request and per-step hooks name their
``engine`` (whose ``config`` is the one configured), so keep per-engine state
keyed by the config, not in module globals that a second engine overwrites.
``engine`` is an ``EngineView``: the engine's facts, read-only; hooks never
reach its scheduler, KV cache or workers.

``fw.testing.conformance.HooksConformance`` checks a hooks plugin against
these contracts; ``contrib/fw-hooks-steplog`` is a complete example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from fw.interfaces.base import Requirements

# Configuration and request types live outside the interfaces (fw.config, fw.sdk.sampling_params), which import
# nothing of fw beyond fw.interfaces and fw.sdk: here they are named by what they are.
FwConfig = Any  # fw.config.FwConfig: the engine's resolved configuration
SamplingParams = Any  # fw.sdk.sampling_params.SamplingParams


@dataclass(frozen=True)
class CliOption:
    """A command-line flag that sets one configuration path (what ``fw_cli_options`` returns)."""

    flag: str  # "--max-num-seqs"
    path: str  # "scheduler.max_num_seqs"
    help: str = ""
    is_flag: bool = False  # boolean: --x / --no-x
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()


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


@hookspec
def fw_configure(config: FwConfig) -> None:
    """An engine starts with this configuration, final now. Called once per engine (``fw plugins check`` calls it
    too, without an engine), so twice for two ``LLM()`` in one process."""


@hookspec
def fw_unconfigure(config: FwConfig) -> None:
    """The engine that ``config`` configured shuts down: release whatever ``fw_configure`` acquired for it."""


@hookspec(firstresult=True)
def fw_detect_quant_format(model_path: str, hf_config: dict[str, Any] | None) -> str | None:
    """Name the quant format of the checkpoint's weights where ``quantization_config.quant_method`` alone does not
    (compressed-tensors' schemes: e.g. "pack-quantized"), or None to pass. The checkpoint format read ``hf_config``."""


@hookspec(firstresult=True)
def fw_default_model() -> str | None:
    """The model to run when none is given (e.g. one a package ships), or None to pass."""


@hookspec
def fw_validate(config: FwConfig, requirements: Requirements) -> list[str]:
    """Return reasons this run cannot work (empty when fine); all are reported together."""


@dataclass(frozen=True)
class EngineView:
    """What hooks (and an engine's callers) see of an engine: facts fixed once it is built, read-only."""

    config: FwConfig  # the object ``fw_configure`` received: key per-engine state by it
    tokenizer: Any  # fw.sdk.tokenizer.Tokenizer: encode, decode, eos_token_id
    vocab_size: int  # the logits' width: every token id a request names is below it
    max_model_len: int
    selected: Mapping[str, str]  # slot -> the name of the plugin serving it ("sampler" -> "default")
    sampler_features: frozenset[str]  # the selected sampler's features ("beam", "structured", ...)
    # What it serves, with vLLM's task names: "generate", and "embed" where the model can pool (fw.pooling).
    supported_tasks: tuple[str, ...] = ("generate",)


@hookspec
def fw_engine_started(engine: EngineView) -> None:
    """The engine is built (model loaded, KV cache allocated) and about to take requests."""


@hookspec
def fw_request_added(
    request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, engine: EngineView
) -> None:
    """A generation request was admitted to ``engine``'s waiting queue (pooling requests reach no request hooks)."""


@hookspec
def fw_logits_processors(
    request_id: str, sampling_params: SamplingParams, engine: EngineView
) -> list[Callable[[list[int], Any], Any]]:
    """Per-request logits processors: ``f(output_token_ids, logits[V]) -> logits[V]``, applied before sampling."""


@hookspec
def fw_request_finished(request_id: str, output: Any, engine: EngineView) -> None:
    """A generation request finished (stopped, hit a length limit, or was aborted); ``output`` is its final
    output."""


@dataclass(frozen=True)
class StepStats:
    """One engine step, as ``fw_step_stats`` receives it."""

    step: int  # index of the step in this engine, from 0; steps that scheduled nothing are not counted
    num_prefill_tokens: int  # prompt tokens computed (chunks of prompts, recomputation after preemption)
    num_decode_tokens: int  # one per request that generated a token from its known tokens
    num_scheduled: int  # requests in the step's batch
    num_preempted: int  # requests evicted to make room in this step (they will be recomputed)
    num_running: int  # after the step
    num_waiting: int
    kv_cache_usage: float  # fraction of KV-cache blocks in use
    prefix_cache_hit_rate: float
    forward_seconds: float  # the model's forward pass, less compile_seconds
    compile_seconds: float  # first-use compilation in the step (native CPU kernels built on first use); 0 after
    step_seconds: float  # the whole step: scheduling, forward, sampling, bookkeeping

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@hookspec
def fw_step_stats(stats: StepStats, engine: EngineView) -> None:
    """Once per step of ``engine`` that ran a batch, with its ``StepStats``."""
