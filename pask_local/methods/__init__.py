"""KV-persistence methods: PASK and the baselines, each a small class with one selection rule."""

from __future__ import annotations

from .base import LayerView, Method
from .full import FullKV
from .h2o import H2O
from .pask import PASK
from .pyramidkv import PyramidKV
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA

BASELINES: dict[str, type[Method]] = {
    "full": FullKV, "streaming": StreamingLLM, "h2o": H2O, "snapkv": SnapKV,
    "pyramidkv": PyramidKV, "tova": TOVA,
}
# pask-prior: PASK with the hand-written prior policy; pask-attn: the model's policy, ranked by
# attention inside each class (within_class_order "attention"); pask-hybrid: structural floors, the
# rest of the budget by attention (engine/factory.py)
# pask-tools: the model's policy with the tool-relevance order (the tools the query's words point to first)
METHOD_NAMES = (*BASELINES, "pask", "pask-prior", "pask-attn", "pask-hybrid", "pask-tools")

__all__ = ["BASELINES", "METHOD_NAMES", "H2O", "PASK", "TOVA", "FullKV", "LayerView", "Method",
           "PyramidKV", "SnapKV", "StreamingLLM"]
