"""Shipped policies: the default for a model (calibrated when we ship one for it, else the nearest
calibrated policy mapped by relative layer depth, else the hand-written prior).

Mapping by relative depth: a policy with groups over ``n_src`` layers is carried to a model with
``n_dst`` layers by placing each group boundary at the same relative depth (boundary b of the source
becomes round(b * n_dst / n_src)); every group keeps its floors and weights. The nearest shipped
calibrated policy is the one of the same architecture with the closest layer count (any
architecture when none matches), ties broken by file name. A mapped policy has kind ``mapped`` and
its provenance says from which policy; ``resolve_default_policy`` also returns a warning line for
the CLI to print.
"""

from __future__ import annotations

import json
from importlib import resources

from ..llm import Model
from .handwritten import handwritten_policy
from .schema import Policy, PolicyError


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


def map_by_depth(policy: Policy, n_layer: int) -> Policy:
    """``policy`` carried to a model with ``n_layer`` layers by relative layer depth (see module doc)."""
    if n_layer <= 0:
        raise PolicyError(f"cannot map a policy to {n_layer} layers")
    src = policy.n_layer
    bounds = [0]
    for layers in policy.groups:
        bounds.append(bounds[-1] + len(layers))
    if sorted(i for g in policy.groups for i in g) != list(range(src)) or any(
            g != list(range(bounds[k], bounds[k + 1])) for k, g in enumerate(policy.groups)):
        raise PolicyError("only policies with contiguous layer groups can be mapped by depth")
    groups, floors, weights = [], [], []
    for k in range(policy.n_groups):
        a, b = round(bounds[k] * n_layer / src), round(bounds[k + 1] * n_layer / src)
        if b > a:
            groups.append(list(range(a, b)))
            floors.append(dict(policy.floors[k]))
            weights.append(dict(policy.weights[k]))
    prov = {
        "mapped_from": policy.provenance.get("file") or policy.provenance.get("model_file") or "policy",
        "mapped_from_model_sha256": policy.provenance.get("model_sha256"),
        "mapped_from_n_layer": src,
        "mapping": "group boundaries at the same relative layer depth (pask_local/policy/shipped.py)",
        "source_provenance": {k: v for k, v in policy.provenance.items() if k != "measurements"},
    }
    return Policy(groups=groups, floors=floors, weights=weights, kind="mapped",
                  within_class_order=policy.within_class_order, never_evict=policy.never_evict,
                  provenance=prov)


def nearest_calibrated(policies: list[Policy], arch: str, n_layer: int) -> Policy | None:
    """The calibrated policy of the same arch with the closest layer count (any arch if none)."""
    cal = [p for p in policies if p.kind == "calibrated"]
    same = [p for p in cal if p.provenance.get("arch") == arch]
    pool = same or cal
    if not pool:
        return None
    return min(pool, key=lambda p: (abs(p.n_layer - n_layer), str(p.provenance.get("file", ""))))


def resolve_default_policy(model: Model) -> tuple[Policy, str | None]:
    """(policy, warning or None) for ``model``: its calibrated policy (by the model file's sha256),
    else the nearest calibrated policy mapped by relative depth (with a warning), else the
    hand-written prior (with a warning)."""
    from ..models import file_sha256

    policies = shipped_policies()
    digest = None
    for pol in policies:
        want = pol.provenance.get("model_sha256")
        if want and pol.kind == "calibrated" and pol.n_layer == model.n_layer:
            digest = digest or file_sha256(model.path)
            if want == digest:
                return pol, None
    near = nearest_calibrated(policies, model.arch, model.n_layer)
    if near is not None:
        mapped = map_by_depth(near, model.n_layer)
        src = mapped.provenance["mapped_from"]
        warning = (f"no calibrated policy for {model.path.name}: using {src} (calibrated on a "
                   f"{near.n_layer}-layer {near.provenance.get('arch', '?')} model) mapped by relative layer depth "
                   f"to {model.n_layer} layers; run pask-local calibrate for a measured one")
        mapped.provenance["warning"] = warning
        return mapped, warning
    warning = (f"no calibrated policy for {model.path.name}: using the hand-written prior; "
               "run pask-local calibrate for a measured one")
    pol = handwritten_policy(model.n_layer)
    pol.provenance["warning"] = warning
    return pol, warning


def default_policy(model: Model) -> Policy:
    """The policy ``resolve_default_policy`` picks (without its warning)."""
    return resolve_default_policy(model)[0]
