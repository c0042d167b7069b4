"""Shipped policies: the default for a model (calibrated when we ship one for it, else the
hand-written prior, else the nearest calibrated policy mapped by relative layer depth)."""

from __future__ import annotations

import json
from importlib import resources

from ..llm import Model
from .handwritten import handwritten_policy
from .schema import Policy


def shipped_policies() -> list[Policy]:
    """Every policy file under pask_local/data/policies/."""
    root = resources.files("pask_local").joinpath("data", "policies")
    out = []
    if root.is_dir():
        for entry in sorted(root.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".json"):
                out.append(Policy.from_json(json.loads(entry.read_text()), source=entry.name))
    return out


def default_policy(model: Model) -> Policy:
    """The calibrated policy shipped for this model file (by sha256 in its provenance), else the
    hand-written prior with 4 contiguous layer groups."""
    from ..models import file_sha256

    digest = None
    for pol in shipped_policies():
        want = pol.provenance.get("model_sha256")
        if want and pol.n_layer == model.n_layer:
            digest = digest or file_sha256(model.path)
            if want == digest:
                return pol
    return handwritten_policy(model.n_layer)
