"""The online engine: constrained decoding with per-layer KV persistence (PASK or a baseline)."""

from .core import Engine, EngineConfig, EngineResult
from .factory import make_method

__all__ = ["Engine", "EngineConfig", "EngineResult", "make_method"]
