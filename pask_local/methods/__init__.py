"""KV-persistence methods: PASK and the baselines, each a small class with one selection rule.

``registry`` is the one list of method names (and PASK variants); ``BASELINES`` and
``METHOD_NAMES`` here are read from it."""

from __future__ import annotations

from .base import LayerView, Method, MethodPlan, PrefillMode
from .full import FullKV
from .h2o import H2O
from .pask import PASK
from .pyramidkv import PyramidKV
from .registry import BASELINES, METHOD_NAMES
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA

__all__ = ["BASELINES", "METHOD_NAMES", "H2O", "PASK", "TOVA", "FullKV", "LayerView", "Method", "MethodPlan",
           "PrefillMode", "PyramidKV", "SnapKV", "StreamingLLM"]
