"""The method study: several ``pask-local eval`` output directories merged into one table per budget.

Long studies run as several processes (one thread each), each with its own output directory; this
module merges their records, keeps the cases that *every* run holds (so each row is measured on the
same cases), and per budget reports each method's accuracy (the unweighted mean over categories,
as ``report``), retention (of Full KV on the same cases), agreement with Full KV's output and wall
seconds, names the best baseline (highest accuracy among the baselines at that budget; ties go to
the earlier in ``BASELINES``), and pairs every PASK variant against it (wins, losses, sign test).
Records made with ``--fidelity`` add each run's pooled fidelity (``eval.fidelity.pool``) and, per
PASK variant, the same pairing on the case's mean KL(Full || method) and gold-call NLL (lower wins).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import PaskError
from ..methods.registry import BASELINES, PASK_VARIANTS
from .data import CATEGORIES
from .fidelity import pool
from .paired import pair, sign_test
from .report import fidelity_cells, fidelity_markdown, num
from .store import CASES_FILE, LATER_KEYS, RUN_FILE, budget_key

# settings that change how a run is scheduled, not what it generates (engine/shared.py keeps the
# outputs of a shared prefill equal to a separate one's)
SCHEDULING_KEYS = ("share_prefill",)

Key = tuple[str, str, str]  # (case id, method, budget key)


class StudyError(PaskError):
    """Output directories that cannot be merged into one table."""


def _read_dir(out: Path) -> tuple[dict[str, Any], dict[Key, dict[str, Any]]]:
    run, cases = out / RUN_FILE, out / CASES_FILE
    if not run.is_file() or not cases.is_file():
        raise StudyError(f"{out} is not a pask-local eval output directory (no {RUN_FILE} and {CASES_FILE})")
    try:
        manifest = json.loads(run.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise StudyError(f"{run} is unreadable") from None
    recs: dict[Key, dict[str, Any]] = {}
    for line in cases.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted write (the store redoes that case)
        if isinstance(r, dict) and {"id", "method", "budget", "valid", "category"} <= r.keys():
            recs[(r["id"], r["method"], budget_key(r["budget"]))] = r
    return manifest, recs


def load_dirs(dirs: Sequence[Path]) -> tuple[dict[str, Any], dict[Key, dict[str, Any]]]:
    """The common manifest and the merged records of ``dirs``; settings that differ are refused."""
    if not dirs:
        raise StudyError("give at least one eval output directory")
    manifest: dict[str, Any] | None = None
    merged: dict[Key, dict[str, Any]] = {}
    for d in dirs:
        m, recs = _read_dir(Path(d))
        m = {**dict.fromkeys(LATER_KEYS), **{k: v for k, v in m.items() if k not in SCHEDULING_KEYS}}
        if manifest is None:
            manifest = m
        else:
            diff = sorted(k for k in manifest.keys() | m.keys() if manifest.get(k) != m.get(k))
            if diff:
                raise StudyError(f"{d} was run with other settings than {dirs[0]} ({', '.join(diff)})")
        for key, r in recs.items():
            if key in merged and merged[key]["output"] != r["output"]:
                raise StudyError(f"{d} and another directory disagree on {key[1]}@{key[2]} for case {key[0]}")
            merged[key] = r
    assert manifest is not None
    return manifest, merged


def run_label(method: str, bkey: str) -> str:
    return method if bkey == "full" else f"{method}@{bkey}"


def run_order(run: tuple[str, str]) -> tuple[int, str, float]:
    """Full KV, the baselines in ``BASELINES`` order, then the PASK variants; budgets high to low."""
    method, bkey = run
    rank = list(BASELINES).index(method) if method in BASELINES else len(BASELINES)
    return rank, method, -(1.0 if bkey == "full" else float(bkey))


def build_study(records: dict[Key, dict[str, Any]], runs: Iterable[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The study's JSON: per budget the rows, the best baseline and the PASK variants paired with it."""
    all_runs = sorted({(m, b) for (_, m, b) in records}, key=run_order)
    runs = list(runs) if runs is not None else all_runs
    missing = [r for r in runs if r not in all_runs]
    if missing:
        raise StudyError("no records for " + ", ".join(run_label(*r) for r in missing))
    if not runs:
        raise StudyError("no records")
    ids_per_run = {r: {i for (i, m, b) in records if (m, b) == r} for r in runs}
    all_ids = set().union(*ids_per_run.values())
    ids = sorted(set.intersection(*ids_per_run.values()))
    if not ids:
        raise StudyError("the runs have no case in common")
    cat_of = {i: records[(i, *runs[0])]["category"] for i in ids}
    known = list(CATEGORIES)  # BFCL's order, then any other category by name
    categories = sorted(set(cat_of.values()), key=lambda c: (known.index(c) if c in known else len(known), c))

    def row(method: str, bkey: str) -> dict[str, Any]:
        recs = [records[(i, method, bkey)] for i in ids]
        per_cat = {}
        for cat in categories:
            rc = [r for r in recs if r["category"] == cat]
            per_cat[cat] = {"n": len(rc), "correct": sum(1 for r in rc if r["valid"])}
        avg = sum(v["correct"] / v["n"] for v in per_cat.values()) / len(per_cat)
        shares = [r["stats"]["budget_used_final"] for r in recs
                  if isinstance(r.get("stats"), dict) and r["stats"].get("budget_used_final") is not None]
        return {"method": method, "budget": None if bkey == "full" else float(bkey), "label": run_label(method, bkey),
                "accuracy": avg, "categories": per_cat, "seconds": round(sum(r.get("seconds", 0.0) for r in recs), 1),
                "max_kv_share": max(shares) if shares else None, "fidelity": pool(recs)}

    rows = {r: row(*r) for r in runs}
    full = rows.get(("full", "full"))
    full_recs = [records[(i, "full", "full")] for i in ids] if full else None
    for (m, b), rw in rows.items():
        rw["retention"] = rw["accuracy"] / full["accuracy"] if full and full["accuracy"] else None
        if full_recs is not None:
            rw["same_as_full"] = pair([records[(i, m, b)] for i in ids], full_recs).same_output / len(ids)

    budgets = sorted({b for (_, b) in runs if b != "full"}, key=float, reverse=True)
    order = list(BASELINES)
    per_budget = []
    for b in budgets:
        here = [rows[r] for r in runs if r[1] == b]
        base = [rw for rw in here if rw["method"] in BASELINES and rw["method"] != "full"]
        best = max(base, key=lambda rw: (rw["accuracy"], -order.index(rw["method"])), default=None)
        versus = []
        if best is not None:
            best_recs = [records[(i, best["method"], b)] for i in ids]
            for rw in here:
                if rw["method"] in PASK_VARIANTS:
                    mine = [records[(i, rw["method"], b)] for i in ids]
                    p = pair(mine, best_recs)
                    v = {"method": rw["method"], "points": round(100 * (rw["accuracy"] - best["accuracy"]), 2),
                         **p.as_dict()}
                    if rw["fidelity"] and best["fidelity"]:
                        v["kl"] = pair_lower(mine, best_recs, "kl")
                        v["gold_nll"] = pair_lower(mine, best_recs, "gold_nll")
                    versus.append(v)
        per_budget.append({"budget": float(b), "best_baseline": best["method"] if best else None,
                           "pask_vs_best": versus})
    return {"n_cases": len(ids), "case_ids": ids, "cases_left_out": len(all_ids) - len(ids), "categories": categories,
            "cases_per_category": {c: sum(1 for i in ids if cat_of[i] == c) for c in categories},
            "runs": [rows[r] for r in runs], "budgets": per_budget}


def pair_lower(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """On the cases both measured, how often ``a``'s per-case fidelity ``key`` is lower than ``b``'s
    (``wins``) and higher (``losses``), the exact sign test, and the mean difference a - b."""
    pairs = []
    for x, y in zip(a, b, strict=True):
        fx, fy = x.get("fidelity") or {}, y.get("fidelity") or {}
        if fx.get(key) is not None and fy.get(key) is not None:
            pairs.append((fx[key], fy[key]))
    wins = sum(1 for x, y in pairs if x < y)
    losses = sum(1 for x, y in pairs if x > y)
    diff = sum(x - y for x, y in pairs) / len(pairs) if pairs else None
    return {"n": len(pairs), "wins": wins, "losses": losses, "p": round(sign_test(wins, losses), 4),
            "mean_diff": diff}


def study_fidelity_markdown(study: dict[str, Any]) -> list[str]:
    """The fidelity tables of ``report`` (runs with ``--fidelity`` records) and their pairing with the
    best baseline."""
    runs = [r for r in study["runs"] if r.get("fidelity")]
    if not runs:
        return []
    lines = ["", "| run | KL | top-1 % | gold NLL | gold dNLL |", "|---|---|---|---|---|"]
    lines += [f"| {r['label']} | " + " | ".join(fidelity_cells(r["fidelity"])) + " |" for r in runs]
    lines += ["", *fidelity_markdown(study)]
    paired = [(b, v) for b in study["budgets"] for v in b["pask_vs_best"] if "kl" in v]
    if paired:
        lines += ["", "Per case, PASK variant vs the best baseline: lower / higher mean KL and gold NLL, "
                  "exact sign test p, mean difference.", "",
                  "| budget | best baseline | PASK variant | KL lower/higher | p | mean dKL | "
                  "gold NLL lower/higher | p | mean dNLL |", "|---|---|---|---|---|---|---|---|---|"]
        for b, v in paired:
            k, g = v["kl"], v["gold_nll"]
            lines.append(f"| {b['budget']:g} | {b['best_baseline']} | {v['method']} | {k['wins']}/{k['losses']} | "
                         f"{k['p']:.3f} | {num(k['mean_diff'], '+.3f')} | {g['wins']}/{g['losses']} | {g['p']:.3f} | "
                         f"{num(g['mean_diff'], '+.3f')} |")
    return lines


def markdown(study: dict[str, Any]) -> str:
    """One table: methods as rows, budgets as columns (accuracy %, retention), then the paired tests."""
    budgets = [b["budget"] for b in study["budgets"]]
    by = {(r["method"], r["budget"]): r for r in study["runs"]}
    methods = list(dict.fromkeys(r["method"] for r in study["runs"]))
    head = "| method | " + " | ".join(f"{b:g}" for b in budgets) + " | wall s |"
    lines = [f"{study['n_cases']} cases, the same for every run ("
             + ", ".join(f"{c} {n}" for c, n in study["cases_per_category"].items())
             + f"); accuracy % (average over categories), retention of Full KV in brackets; "
             f"{study['cases_left_out']} case(s) some run lacks left out.", "", head,
             "|---|" + "---|" * (len(budgets) + 1)]
    for m in methods:
        cells = []
        secs = 0.0
        for b in ([None] if m == "full" else budgets):
            r = by.get((m, b))
            if r is not None:
                secs += r["seconds"]
        for b in budgets:
            r = by.get((m, None if m == "full" else b))
            if r is None or (m == "full" and b != budgets[0]):
                cells.append("")
                continue
            ret = f" ({r['retention']:.2f})" if r.get("retention") is not None and m != "full" else ""
            cells.append(f"{100 * r['accuracy']:.1f}{ret}")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {secs:.0f} |")
    lines += ["", "| budget | best baseline | PASK variant | points | right/wrong vs best | sign test p | same output |",
              "|---|---|---|---|---|---|---|"]
    for b in study["budgets"]:
        for v in b["pask_vs_best"]:
            lines.append(f"| {b['budget']:g} | {b['best_baseline']} | {v['method']} | {v['points']:+.1f} | "
                         f"{v['wins']}/{v['losses']} | {v['p']:.3f} | {v['same_output']}/{v['n']} |")
    lines += study_fidelity_markdown(study)
    return "\n".join(lines) + "\n"


def plot(study: dict[str, Any], path: Path) -> None:
    """Accuracy against budget, one line per method, Full KV as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in study["runs"]))
    for m in methods:
        pts = sorted((r["budget"], 100 * r["accuracy"]) for r in study["runs"] if r["method"] == m and r["budget"])
        if m == "full":
            acc = next(100 * r["accuracy"] for r in study["runs"] if r["method"] == "full")
            ax.axhline(acc, color="black", linestyle="--", label="full")
        elif pts:
            ax.plot(*zip(*pts, strict=True), marker="o", linewidth=2.2 if m in PASK_VARIANTS else 1.2, label=m)
    ax.set_xlabel("KV budget (share of Full KV's entries)")
    ax.set_ylabel("accuracy % (mean over categories)")
    ax.set_title(f"{study['n_cases']} cases, the same for every run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
