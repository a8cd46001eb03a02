"""The beam sampler: the default sampler's sampling, declaring the "beam" feature that ``LLM.beam_search`` needs.

The search itself is the engine's (fw.engine.beam_search); it ranks candidates by this sampler's logprobs.
"""
