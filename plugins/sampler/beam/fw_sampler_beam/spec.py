from fw.interfaces import sampler
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec

SPEC = PluginSpec(
    name="beam",
    kind="sampler",
    impl="fw_sampler_beam.sampler:BeamSearchSampler",
    capabilities=sampler.SamplerCapabilities(features=frozen("seed", "logprobs", "penalties", "beam")),
    api_version=sampler.API_VERSION,
    description="Beam search (LLM.beam_search) on top of the default sampler, which serves ordinary requests.",
)
