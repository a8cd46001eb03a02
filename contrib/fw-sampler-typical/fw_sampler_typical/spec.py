# The entry point names this module: keep it light (no torch), so `fw plugins list` stays fast.
from pydantic import BaseModel, Field

from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class TypicalOptions(BaseModel, extra="forbid"):
    mass: float = Field(0.9, gt=0, le=1, description="Probability mass of the most typical tokens to keep.")


SPEC = PluginSpec(
    name="typical",
    kind="sampler",
    impl="fw_sampler_typical.sampler:TypicalSampler",
    capabilities=sampler.SamplerCapabilities(features=frozen("seed")),
    api_version=1,
    description="Locally typical sampling: keep the tokens whose surprise is closest to the entropy.",
    options=TypicalOptions,
)
