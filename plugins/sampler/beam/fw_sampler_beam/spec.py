from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec

SPEC = PluginSpec(
    name="beam",
    kind="sampler",
    impl="fw.sdk.sampler:DefaultSampler",
    capabilities=sampler.SamplerCapabilities(features=frozen("seed", "logprobs", "penalties", "beam")),
    api_version=1,
    description="The default sampler, with the 'beam' feature that LLM.beam_search (fw.engine.beam_search) needs.",
)
