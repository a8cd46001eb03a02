from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec

SPEC = PluginSpec(
    name="default",
    kind="sampler",
    impl="fw.sdk.sampler:DefaultSampler",
    capabilities=sampler.SamplerCapabilities(features=frozen("seed", "logprobs", "penalties")),
    api_version=1,
    priority=1,  # above beam (a superset only for LLM.beam_search), below structured-output samplers
    description="vLLM SamplingParams: penalties, logit bias, temperature, top-k/p, min-p, seeds, logprobs; vectorised.",
)
