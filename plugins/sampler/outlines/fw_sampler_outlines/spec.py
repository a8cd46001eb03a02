# The entry point names this module: keep it light (no torch, no outlines_core), so `fw plugins list` stays fast.
from pydantic import BaseModel, Field

from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec


class OutlinesOptions(BaseModel, extra="forbid"):
    compile_threads: int = Field(1, ge=1, description="Background threads compiling constraints into token automata.")
    whitespace_pattern: str | None = Field(
        None, description="Regex for the whitespace allowed between JSON tokens (default: at most one space)."
    )
    cache_size: int = Field(64, ge=1, description="Compiled constraints kept per sampler (least recently used go).")


SPEC = PluginSpec(
    name="outlines",
    kind="sampler",
    impl="fw_sampler_outlines.sampler:OutlinesSampler",
    capabilities=sampler.SamplerCapabilities(
        features=frozen("seed", "logprobs", "penalties", "structured"), requires_modules=("outlines_core", "jsonschema")
    ),
    api_version=sampler.API_VERSION,
    priority=2,  # "auto" prefers it to default: a superset, and unconstrained requests cost the same
    description="The default sampler plus structured output (JSON schema/object, regex, choice) via outlines-core.",
    options=OutlinesOptions,
)
