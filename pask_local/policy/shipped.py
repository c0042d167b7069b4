"""Shipped policies: the default for a model is the calibrated policy shipped for that exact model
file (matched by sha256), else the hand-written prior with a notice for the CLI to print. A policy
calibrated on another model is never used silently (see ``resolve_default_policy``)."""

from __future__ import annotations

import json
from importlib import resources

from ..llm import Model
from .handwritten import handwritten_policy
from .schema import Policy


def shipped_policies() -> list[Policy]:
    """Every policy file under pask_local/data/policies/ (its file name in provenance["file"])."""
    root = resources.files("pask_local").joinpath("data", "policies")
    out = []
    if root.is_dir():
        for entry in sorted(root.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".json"):
                pol = Policy.from_json(json.loads(entry.read_text()), source=entry.name)
                pol.provenance.setdefault("file", entry.name)
                out.append(pol)
    return out


def resolve_default_policy(model: Model) -> tuple[Policy, str | None]:
    """(policy, notice or None) for ``model``: its own calibrated policy (matched by the model file's
    sha256), else the hand-written prior with a notice. A policy calibrated on another model is never
    the default: mapped by depth from Gemma 3 270M to Qwen2.5-Coder-1.5B it collapsed accuracy
    (16.7% vs the prior's 89.6% at budget 0.2, issue 18)."""
    from ..models import file_sha256

    digest = None
    for pol in shipped_policies():
        want = pol.provenance.get("model_sha256")
        if want and pol.kind == "calibrated" and pol.n_layer == model.n_layer:
            digest = digest or file_sha256(model.path)
            if want == digest:
                return pol, None
    warning = (f"no calibrated policy for {model.path.name}: using the hand-written prior; "
               "run pask-local calibrate for a measured one")
    pol = handwritten_policy(model.n_layer)
    pol.provenance["warning"] = warning
    return pol, warning


def default_policy(model: Model) -> Policy:
    """The policy ``resolve_default_policy`` picks (without its warning)."""
    return resolve_default_policy(model)[0]
