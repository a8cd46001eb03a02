from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec

SPEC = PluginSpec(
    name="default",
    kind="sampler",
    impl="fw_sampler_default.sampler:DefaultSampler",
    capabilities=sampler.SamplerCapabilities(features=frozen("seed", "logprobs", "penalties")),
    api_version=sampler.API_VERSION,
    priority=1,  # above beam (a superset only for LLM.beam_search), below structured-output samplers
    description="vLLM SamplingParams: penalties, logit bias, temperature, top-k/p, min-p, seeds, logprobs; vectorised.",
)
