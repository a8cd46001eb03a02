"""Flywheel: a plugin-based LLM inference engine.

``from fw import LLM, SamplingParams`` loads the engine lazily, so importing
``fw`` for plugin listing or configuration never pulls in torch.
"""

from typing import TYPE_CHECKING

from fw.inputs import TextPrompt, TokensPrompt
from fw.interfaces.hooks import hookimpl

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fw.llm import LLM
    from fw.pooling import PoolingParams
    from fw.sdk.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from fw.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fw.sdk.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from fw.pooling import PoolingParams

        return PoolingParams
    raise AttributeError(f"module 'fw' has no attribute {name!r}")


__all__ = ["LLM", "PoolingParams", "SamplingParams", "TextPrompt", "TokensPrompt", "__version__", "hookimpl"]
