"""The engine package: the engine core and the clients that front it (fw.engine.client says what callers may use).

``from fw.engine import LLMEngine, EngineError`` names the engine and its error for users; everything else is
imported from its own module.
"""

from fw.engine.client import EngineError
from fw.engine.core import LLMEngine

__all__ = ["EngineError", "LLMEngine"]
