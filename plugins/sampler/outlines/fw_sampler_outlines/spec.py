# The entry point names this module: keep it light (no torch, no outlines_core), so `fw plugins list` stays fast.
from pydantic import BaseModel, ByteSize, Field

from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class OutlinesOptions(BaseModel, extra="forbid"):
    compile_workers: int = Field(
        2, ge=1, description="Worker processes compiling constraints into token automata (in the background)."
    )
    compile_timeout: float = Field(
        10.0, gt=0, description="Seconds a constraint may compile; past that its worker is killed, the request fails."
    )
    compile_memory: ByteSize = Field(
        4 * 1024**3, gt=0, description="Address space of a compile worker; a constraint needing more fails."
    )
    max_regex_length: int = Field(32768, ge=1, description="Characters of the regex a constraint becomes, at most.")
    max_repeat: int = Field(
        256, ge=1, description="Largest counted repetition ({m,n}, maxLength, maxItems) in a constraint's regex."
    )
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
    api_version=1,
    priority=2,  # "auto" prefers it to default: a superset, and unconstrained requests cost the same
    description="The default sampler plus structured output (JSON schema/object, regex, choice) via outlines-core.",
    options=OutlinesOptions,
)
