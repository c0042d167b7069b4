"""Builds a KV-persistence method by name (CLI, eval harness), resolving PASK's policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..errors import PaskError
from ..llm import Model
from ..methods import BASELINES, METHOD_NAMES, PASK, Method
from ..model_info import swa_layers
from ..policy import Policy
from ..policy.handwritten import handwritten_policy, hybrid_policy
from ..policy.shipped import resolve_default_policy

PASK_VARIANTS = ("pask", "pask-prior", "pask-attn", "pask-hybrid", "pask-tools")
# the methods that run the model's default (resolved) policy when none is given
DEFAULT_POLICY_METHODS = ("pask", "pask-attn", "pask-tools")
# the methods that take a policy file (--policy)
POLICY_METHODS = ("pask", "pask-attn", "pask-hybrid", "pask-tools")
# what `pask-local run` runs when no --method is given: the variant best on the calibration split
# (docs/results.md, "PASK holds the prompt's tail": pask-hybrid 48.2% over 0.33 and 0.2, the prior
# 43.8, SnapKV 40.0); with --policy and no --method, that policy runs as `pask`. The server keeps
# `pask` (it evicts while prefilling, so a slot holds a prompt longer than the slot's budget and a
# finished request's prefix is reused: docs/server.md).
RUN_DEFAULT_METHOD = "pask-hybrid"


def default_run_method(method: str | None, policy: object | None) -> str:
    """``--method`` as given, else ``pask`` when a policy file is given, else ``RUN_DEFAULT_METHOD``."""
    if method is not None:
        return method
    return "pask" if policy is not None else RUN_DEFAULT_METHOD


def make_method(name: str, model: Model, policy: str | Path | Policy | None = None,
                warn: Callable[[str], None] | None = None) -> Method:
    """``name`` in METHOD_NAMES; ``policy`` (PASK only): a Policy, a policy file, or None (the
    model's default; ``warn`` receives the line saying when that is the hand-written prior).
    ``pask-prior`` is PASK with the hand-written prior (``policy/handwritten.py``), for comparisons;
    ``pask-attn`` is PASK with the resolved policy's class shares, ranked by attention inside each
    class (its ``within_class_order`` set to ``attention``); ``pask-hybrid`` keeps only a policy's
    floors as class quotas (by default ``hybrid_policy``'s) and gives the rest of the budget to the
    tokens attention ranks highest, whatever their class; ``pask-tools`` is PASK with the resolved
    policy's class shares and the ``tool-relevance`` order (inside a class, the entries of the tools
    the query's words point to persist first; decided before prefill)."""
    if name not in METHOD_NAMES:
        raise PaskError(f"unknown method '{name}' (choose from {', '.join(METHOD_NAMES)})")
    if name not in PASK_VARIANTS:
        if policy is not None:
            raise PaskError(f"--policy applies to pask, pask-attn, pask-hybrid and pask-tools only, not '{name}'")
        return BASELINES[name]()
    if name == "pask-prior":
        if policy is not None:
            raise PaskError("pask-prior runs the hand-written prior policy; use --method pask with --policy")
        pol = handwritten_policy(model.n_layer)
    elif name == "pask-hybrid" and policy is None:
        pol = hybrid_policy(model.n_layer)
    elif policy is None:
        pol, warning = resolve_default_policy(model)
        if warning and warn is not None:
            warn(warning)
    elif isinstance(policy, Policy):
        pol = policy
    else:
        pol = Policy.load(policy)
    pol.check_model(model.n_layer)
    if name == "pask-attn":
        pol = dataclasses.replace(pol, within_class_order="attention")
    elif name == "pask-tools":
        pol = dataclasses.replace(pol, within_class_order="tool-relevance")
    elif name == "pask-hybrid":
        pol = dataclasses.replace(pol, within_class_order="attention", residual="attention")
    swa, window = swa_layers(model)
    method = PASK(pol, swa_layers=swa, window=window)
    method.name = name  # the variant's name: what traces and stats report
    return method
