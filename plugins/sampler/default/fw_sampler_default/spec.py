from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec

SPEC = PluginSpec(
    name="default",
    kind="sampler",
    impl="fw_sampler_default.sampler:DefaultSampler",
    capabilities=sampler.SamplerCapabilities(features=frozen("seed", "logprobs")),
    api_version=sampler.API_VERSION,
    description="Greedy and temperature/top-k/top-p sampling with per-request seeds, vectorised over the batch.",
)
