"""Which prompt positions each layer keeps: pask-local's PASK plan for a tagged prompt, as index lists.

The selection is pask-local's own: ``PASK.bind`` compiles the policy at the budget for the prompt's
class counts (structural floors first, then the policy's weights; per-layer capacities), and
``PASKPlan.select`` picks each layer's positions (never-evict classes, the held question tail,
class quotas in the policy's within-class order, protection order for rounding). This module only
asks it once per layer for the whole prompt, as the engine's planned prefill does
(``engine.run.Run._prompt_plan``), and leaves sliding-window layers alone (None), as that plan does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..classes import StructuralClass, class_index
from ..errors import PaskError
from ..methods import LayerView
from ..methods.pask import PASK
from ..policy import Policy
from ..policy.handwritten import handwritten_policy


def pask_method(policy: Policy | str | Path | None, n_layer: int, swa_layers: tuple[int, ...] = (),
                window: int = 0) -> PASK:
    """PASK with ``policy`` (None: the hand-written prior, i.e. pask-local's default ``pask-prior``;
    a path: a policy file, as ``--method pask --policy FILE``)."""
    if policy is None:
        pol = handwritten_policy(n_layer)
    elif isinstance(policy, Policy):
        pol = policy
    else:
        pol = Policy.load(policy)
    pol.check_model(n_layer)
    method = PASK(pol, swa_layers=swa_layers, window=window)
    if method.needs_attention or method.prompt_scorer:
        # kvpress hands a press no attention statistic of the prompt's last queries (SnapKV's window)
        # and runs no scoring pass of pask-local's
        raise PaskError(f"policy order '{pol.within_class_order}' ranks by attention: PASKPress runs the "
                        "structural orders only (pask-local's pask-attn / pask-hybrid / pask-zip do attention)")
    return method


def class_ids(classes: Sequence[StructuralClass | int]) -> np.ndarray:
    """Class indices (``classes.class_index``) of a prompt's tokens."""
    return np.array([c if isinstance(c, int | np.integer) else class_index(c) for c in classes], dtype=np.int64)


def prompt_keep(method: PASK, budget: float, classes: np.ndarray, n_layer: int,
                pieces: list[str] | None = None) -> list[np.ndarray | None]:
    """Per layer, the sorted prompt positions PASK keeps at ``budget`` (None: a sliding-window layer)."""
    n = len(classes)
    plan = method.bind(budget, classes, n_layer, pieces)
    positions = np.arange(n)
    out: list[np.ndarray | None] = []
    for il in range(n_layer):
        if il in method.swa_layers and method.window > 0:
            out.append(None)
            continue
        view = LayerView(layer=il, n_layer=n_layer, positions=positions, classes=classes, prompt_len=n,
                         all_classes=classes)
        out.append(np.sort(plan.select(view, plan.capacities[il])))
    return out
