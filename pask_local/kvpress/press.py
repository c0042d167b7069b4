"""``PASKPress``: pask-local's structural persistence policy as a kvpress press (HF transformers).

The press is told the prompt's structural classes (``bind``: from ``vocab.tag_request`` or a
pask-local ``Prompt``) before the prefill. When the prefill's attention layer ``il`` has written its
K/V, the press keeps exactly the positions pask-local's PASK plan keeps in that layer at budget
``1 - compression_ratio`` (``keep.prompt_keep``): per layer group, the policy's structural floors
first, then its weights, in its within-class order. Layers may keep different counts (a policy whose
groups differ); every layer of the cache then has its own length.

What does not carry over from pask-local: kvpress compresses once, after a whole prefill (pask-local's
planned prefill evicts between 64-token chunks, so later prompt tokens there attend to the kept
entries only), and the generated tokens all stay (pask-local's budget also covers them, and its
parser-state classes decide which prompt entries give way while the call is written).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvpress import BasePress
from torch import nn

from ..classes import StructuralClass
from ..errors import PaskError
from ..policy import Policy
from .keep import class_ids, pask_method, prompt_keep


@dataclass
class PASKPress(BasePress):
    """Keep, per layer, what PASK keeps of the bound prompt at budget ``1 - compression_ratio``.

    ``policy``: None (pask-local's default ``pask-prior``: the hand-written prior), a ``Policy`` or a
    policy file (``docs/policy-format.md``). ``bind(classes, tokens)`` before each prefill.
    """

    compression_ratio: float = 0.0
    policy: Policy | str | Path | None = None
    _classes: np.ndarray | None = field(default=None, init=False, repr=False)
    _tokens: list[int] | None = field(default=None, init=False, repr=False)
    _pieces: list[str] | None = field(default=None, init=False, repr=False)
    _keep: list[torch.Tensor | None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1), got {self.compression_ratio}")

    @property
    def budget(self) -> float:
        """The KV budget pask-local would be given (1 - ratio, rounded so 1 - 0.67 is 0.33 exactly:
        the compiled quotas round up, and 0.32999999999999996 can round a class one token lower)."""
        return round(1.0 - self.compression_ratio, 9)

    def bind(self, classes: Sequence[StructuralClass | int], tokens: Sequence[int] | None = None,
             pieces: list[str] | None = None) -> PASKPress:
        """The next prefill is this prompt: one class per token; ``tokens`` (checked against the
        prefill's input ids when given); ``pieces`` (token texts) for the ``tool-relevance`` order."""
        if tokens is not None and len(tokens) != len(classes):
            raise PaskError(f"{len(tokens)} tokens but {len(classes)} classes")
        self._classes = class_ids(classes)
        self._tokens = [int(t) for t in tokens] if tokens is not None else None
        self._pieces = pieces
        self._keep = None
        return self

    def keep_sets(self, n_layer: int, swa_layers: tuple[int, ...] = (), window: int = 0
                  ) -> list[np.ndarray | None]:
        """Per layer, the prompt positions this press keeps (None: the layer is left whole)."""
        if self._classes is None:
            raise PaskError("PASKPress: bind(classes) the prompt before the prefill")
        method = pask_method(self.policy, n_layer, swa_layers, window)
        return prompt_keep(method, self.budget, self._classes, n_layer, self._pieces)

    def post_init_from_model(self, model: Any) -> None:
        if self.compression_ratio == 0:
            return
        config = model.config.get_text_config()
        swa, window = _sliding_layers(config)
        keep = self.keep_sets(config.num_hidden_layers, swa, window)
        device = model.device
        self._keep = [None if k is None else torch.as_tensor(k, dtype=torch.long, device=device) for k in keep]

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compression_ratio == 0:
            return keys, values
        assert self._keep is not None and self._classes is not None  # set by post_init_from_model
        if keys.shape[2] != len(self._classes):
            raise PaskError(f"PASKPress is bound to a prompt of {len(self._classes)} tokens, but the prefill "
                            f"holds {keys.shape[2]}: bind the prompt that is prefilled")
        keep = self._keep[module.layer_idx]
        if keep is None:
            return keys, values
        return keys.index_select(2, keep).contiguous(), values.index_select(2, keep).contiguous()

    @contextmanager
    def __call__(self, model: Any) -> Generator:
        # the prefill's token ids are checked against the bound ones: a press bound to another prompt
        # of the same length would otherwise keep positions that mean nothing here
        language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
        hook = language_model.register_forward_pre_hook(self._check_ids, with_kwargs=True)
        try:
            with super().__call__(model):
                yield
        finally:
            hook.remove()

    def _check_ids(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        if self._tokens is None or ids is None or (cache is not None and cache.get_seq_length() > 0):
            return  # nothing to check, or a decode step after the prefill
        for row in ids.tolist():
            if row != self._tokens:
                raise PaskError("PASKPress: the prefill's token ids are not the bound prompt's tokens")


def _sliding_layers(config: Any) -> tuple[tuple[int, ...], int]:
    """(sliding-window layers, window) from an HF config (((), 0) for all-global models such as Qwen2.5)."""
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None) or 0
    swa = tuple(il for il, t in enumerate(types) if t == "sliding_attention")
    return (swa, int(window)) if swa and window else ((), 0)
