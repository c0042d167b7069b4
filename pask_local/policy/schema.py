"""The persistence policy file: a versioned JSON document, loaded and validated here.

A policy says, for each (layer group, structural class), a protection floor in [0, 1] (the minimum
fraction of that class's tokens kept in that group) and a residual weight (how much of the capacity
left after the floors that cell deserves per token). Layer groups are a partition of the model's
layers, written out so a policy can be checked against a model. See docs/policy-format.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..classes import StructuralClass
from ..errors import PaskError
from ..jsonfile import read_json_file
from .groups import GroupCurves

FORMAT_VERSION = 1
KINDS = ("hand-written", "calibrated", "mapped")
# Which tokens of a class go first when only part of it persists: the oldest, the newest, or the
# tails of spans (a span is a run of same-class tokens, e.g. one description: its first tokens persist);
# ``tool-relevance``: span-head, but the entries of the tools the query's words point to persist first
# (``tagging.relevance``, decided before prefill from the prompt's text); ``attention``: by attention;
# ``reconstruction``: by the attention a re-presentation of the part before the user's turn pays each
# entry (``kvzip``'s scoring pass, run before prefill; it never reads the question).
ORDERS = ("oldest-first", "newest-first", "span-head", "attention", "tool-relevance", "reconstruction")
# What the capacity left after the floors goes to: ``weights`` (water-filled over the classes by
# weight, then ranked inside each class) or ``attention`` (no class shares beyond the floors: the
# highest-attention tokens of any class; needs within_class_order "attention") or ``recent`` (no class
# shares beyond the floors: the newest tokens of any class; needs within_class_order "newest-first") or
# ``reconstruction`` (as ``attention``, by the reconstruction score; needs within_class_order "reconstruction").
RESIDUALS = ("weights", "attention", "recent", "reconstruction")
_RESIDUAL_ORDER = {"attention": "attention", "recent": "newest-first", "reconstruction": "reconstruction"}


class PolicyError(PaskError):
    """A policy file is malformed or does not fit the model."""


@dataclass
class Policy:
    groups: list[list[int]]
    floors: list[dict[StructuralClass, float]]
    weights: list[dict[StructuralClass, float]]
    kind: str = "hand-written"
    within_class_order: str = "oldest-first"
    never_evict: tuple[StructuralClass, ...] = (StructuralClass.SINK,)
    provenance: dict[str, Any] = field(default_factory=dict)
    residual: str = "weights"
    group_budget: GroupCurves | None = None  # per-group sensitivity curves: how the budget is split (policy/groups)

    def __post_init__(self) -> None:
        if self.group_budget is not None and len(self.group_budget.dnll) != len(self.groups):
            raise PolicyError(f"group_budget has {len(self.group_budget.dnll)} curves for {len(self.groups)} groups")
        if self.residual not in RESIDUALS:
            raise PolicyError(f"residual must be one of {', '.join(RESIDUALS)}, got {_show(self.residual)}")
        need = _RESIDUAL_ORDER.get(self.residual)
        if need is not None and self.within_class_order != need:
            raise PolicyError(f"residual '{self.residual}' needs within_class_order '{need}'")

    @property
    def n_layer(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    def group_of_layer(self) -> list[int]:
        out = [0] * self.n_layer
        for g, layers in enumerate(self.groups):
            for il in layers:
                out[il] = g
        return out

    def check_model(self, n_layer: int) -> None:
        if self.n_layer != n_layer:
            raise PolicyError(
                f"policy covers {self.n_layer} layers but the model has {n_layer} "
                "(use a policy for this model, or let pask-local map one by relative depth)"
            )

    # --- (de)serialisation ---
    def to_json(self) -> dict[str, Any]:
        out = {
            "format": "pask-policy",
            "version": FORMAT_VERSION,
            "kind": self.kind,
            "n_layer": self.n_layer,
            "groups": self.groups,
            "within_class_order": self.within_class_order,
            "residual": self.residual,
            "never_evict": [c.value for c in self.never_evict],
            "floors": [{c.value: v for c, v in f.items()} for f in self.floors],
            "weights": [{c.value: v for c, v in w.items()} for w in self.weights],
            "provenance": self.provenance,
        }
        if self.group_budget is not None:
            out["group_budget"] = self.group_budget.to_json()
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: Any, source: str = "policy") -> Policy:
        if not isinstance(data, dict) or data.get("format") != "pask-policy":
            raise PolicyError(f"{source}: not a pask policy (missing \"format\": \"pask-policy\")")
        if data.get("version") != FORMAT_VERSION or isinstance(data.get("version"), bool):
            raise PolicyError(f"{source}: unsupported policy version {data.get('version')!r}")
        kind = data.get("kind")
        if not isinstance(kind, str) or kind not in KINDS:
            raise PolicyError(f"{source}: kind must be one of {', '.join(KINDS)}")
        groups = data.get("groups")
        if not isinstance(groups, list) or not groups or not all(
            isinstance(g, list) and g and all(_is_int(i) for i in g) for g in groups
        ):
            raise PolicyError(f"{source}: groups must be a non-empty list of non-empty lists of layer indices")
        flat = sorted(i for g in groups for i in g)
        if flat != list(range(len(flat))):
            raise PolicyError(f"{source}: groups must partition layers 0..{len(flat) - 1} exactly once")
        n_layer = data.get("n_layer", len(flat))
        if not _is_int(n_layer) or n_layer != len(flat):
            raise PolicyError(f"{source}: n_layer {_show(n_layer)} disagrees with groups ({len(flat)})")
        order = data.get("within_class_order", "oldest-first")
        if not isinstance(order, str) or order not in ORDERS:
            raise PolicyError(f"{source}: within_class_order must be one of {', '.join(ORDERS)}")
        floors = _class_tables(data.get("floors"), len(groups), source, "floors", upper=1.0)
        weights = _class_tables(data.get("weights"), len(groups), source, "weights", upper=None)
        never_raw = data.get("never_evict", ["sink"])
        if not isinstance(never_raw, list):
            raise PolicyError(f"{source}: never_evict must be a list of class names")
        never = tuple(_cls(v, source, "never_evict") for v in never_raw)
        provenance = data.get("provenance", {})
        if not isinstance(provenance, dict):
            raise PolicyError(f"{source}: provenance must be an object")
        curves = _group_curves(data.get("group_budget"), len(groups), source)
        try:  # residual: checked by the constructor
            return cls(groups=groups, floors=floors, weights=weights, kind=kind, within_class_order=order,
                       never_evict=never, provenance=dict(provenance), residual=data.get("residual", "weights"),
                       group_budget=curves)
        except PolicyError as exc:
            raise PolicyError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        return cls.from_json(read_json_file(path, "policy", PolicyError), source=str(path))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(value: Any) -> str:
    """A value for a one-line message: JSON-ish, non-printable characters escaped, cut at 60."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in repr(value))
    return text if len(text) <= 60 else text[:60] + "..."


def _cls(value: Any, source: str, where: str) -> StructuralClass:
    try:
        return StructuralClass(value)
    except (ValueError, TypeError):
        raise PolicyError(f"{source}: unknown structural class {_show(value)} in {where}") from None


def _group_curves(raw: Any, n_groups: int, source: str) -> GroupCurves | None:
    """The optional ``group_budget`` object: increasing levels in (0, 1), one finite curve per group."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("levels"), list) or not isinstance(raw.get("dnll"), list):
        raise PolicyError(f"{source}: group_budget must be an object with lists 'levels' and 'dnll'")
    levels = raw["levels"]
    if not levels or len(levels) > 32 or not all(_finite(v) and 0 < v < 1 for v in levels) or any(
            b <= a for a, b in zip(levels, levels[1:], strict=False)):
        raise PolicyError(f"{source}: group_budget.levels must be 1-32 increasing numbers in (0, 1), "
                          f"got {_show(levels)}")
    curves = raw["dnll"]
    if len(curves) != n_groups or not all(
            isinstance(c, list) and len(c) == len(levels) and all(_finite(v) for v in c) for c in curves):
        raise PolicyError(f"{source}: group_budget.dnll must hold one list of {len(levels)} finite numbers "
                          f"per group ({n_groups})")
    min_share = raw.get("min_share", 0.0)
    if not _finite(min_share) or not 0 <= min_share <= 1:
        raise PolicyError(f"{source}: group_budget.min_share must be a number in [0, 1], got {_show(min_share)}")
    return GroupCurves(tuple(float(v) for v in levels), tuple(tuple(float(v) for v in c) for c in curves),
                       float(min_share))


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _class_tables(raw: Any, n_groups: int, source: str, name: str,
                  upper: float | None) -> list[dict[StructuralClass, float]]:
    if not isinstance(raw, list) or len(raw) != n_groups:
        raise PolicyError(f"{source}: {name} must be a list with one table per group ({n_groups})")
    tables = []
    for g, table in enumerate(raw):
        if not isinstance(table, dict):
            raise PolicyError(f"{source}: {name}[{g}] must be an object class -> number")
        out: dict[StructuralClass, float] = {}
        for key, value in table.items():
            c = _cls(key, source, f"{name}[{g}]")
            if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
                    or value < 0 or (upper is not None and value > upper)):
                bound = f"[0, {upper}]" if upper is not None else ">= 0 (finite)"
                raise PolicyError(f"{source}: {name}[{g}][{c.value}] = {_show(value)} must be a number in {bound}")
            out[c] = float(value)
        for c in StructuralClass:
            out.setdefault(c, 0.0)
        tables.append(out)
    return tables


def contiguous_groups(n_layer: int, n_groups: int = 4) -> list[list[int]]:
    """Split layers 0..n_layer-1 into n_groups contiguous groups of near-equal size."""
    n_groups = max(1, min(n_groups, n_layer))
    bounds = [round(i * n_layer / n_groups) for i in range(n_groups + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n_groups)]
