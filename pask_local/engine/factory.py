"""Builds a KV-persistence method by name (CLI, eval harness, server): ``methods.registry`` holds
the names, their help and how each is built; this module keeps the engine-side entry points."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..llm import Model
from ..methods import Method, registry
from ..methods.registry import (  # noqa: F401  (re-exported: callers import them from here)
    DEFAULT_METHOD,
    DEFAULT_POLICY_METHODS,
    PASK_VARIANTS,
    POLICY_METHODS,
)
from ..policy import Policy


def default_run_method(method: str | None, policy: object | None, default: str = DEFAULT_METHOD) -> str:
    """``--method`` as given, else ``pask`` when a policy file is given, else ``default``
    (``compress`` passes ``DEFAULT_PREFIX_METHOD``)."""
    if method is not None:
        return method
    return registry.POLICY_FILE_METHOD if policy is not None else default


def make_method(name: str, model: Model, policy: str | Path | Policy | None = None,
                warn: Callable[[str], None] | None = None) -> Method:
    """The registered method ``name`` (``methods.registry``) on ``model``; ``policy`` (the PASK
    variants that take one): a Policy, a policy file, or None (the variant's default; ``warn``
    receives the line saying when the model's default is the hand-written prior). A PaskError for an
    unknown name or a policy the method does not take."""
    return registry.make(name, model, policy, warn)
