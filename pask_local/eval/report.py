"""Turns stored per-case records into the summary JSON, the markdown table and the accuracy plot.

Accuracy is per category; the average is the unweighted mean over the categories evaluated (BFCL
style). Retention is a method's accuracy divided by Full-KV accuracy on the same cases (None when
Full KV was not run or scored 0). Agreement is the share of a method's cases whose output is
character-for-character Full KV's output on the same case: a finer fidelity measure than accuracy
when the model is weak (a compressed cache can turn a wrong call into a right one by chance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .data import Case
from .fidelity import GROUP_NAMES, pool
from .sizing import load_skipped
from .store import ResultStore, budget_key

SUMMARY_FILE = "summary.json"
TABLE_FILE = "results.md"
PLOT_FILE = "accuracy.png"
FIDELITY_PLOT_FILE = "fidelity.png"


def _label(method: str, budget: float | None) -> str:
    return method if budget is None else f"{method}@{budget:g}"


def summarize(store: ResultStore, cases: list[Case], runs: list[tuple[str, float | None]]) -> dict[str, Any]:
    categories = list(dict.fromkeys(c.category for c in cases))
    rows = []
    for method, budget in runs:
        per_cat: dict[str, dict[str, Any]] = {}
        seconds = 0.0
        n_gen = n_prompt = n_reused = n_err = 0
        all_recs: list[dict[str, Any]] = []
        for cat in categories:
            recs = [store.records.get((c.id, method, budget_key(budget))) for c in cases if c.category == cat]
            recs = [r for r in recs if r is not None]
            all_recs += recs
            correct = sum(1 for r in recs if r["valid"])
            per_cat[cat] = {"n": len(recs), "correct": correct,
                            "accuracy": correct / len(recs) if recs else None}
            for r in recs:
                seconds += r.get("seconds", 0.0)
                n_gen += r.get("n_generated", 0)
                n_prompt += r.get("n_prompt", 0)
                n_reused += r.get("n_reused", 0)
                n_err += r.get("error_type") == "generation_error"
        accs = [v["accuracy"] for v in per_cat.values() if v["accuracy"] is not None]
        rows.append({
            "method": method, "budget": budget, "label": _label(method, budget), "categories": per_cat,
            "average": sum(accs) / len(accs) if accs else None,
            "n": sum(v["n"] for v in per_cat.values()), "seconds": round(seconds, 2),
            "generated_tokens": n_gen, "prompt_tokens": n_prompt, "prompt_tokens_reused": n_reused,
            "generation_errors": n_err, "fidelity": pool(all_recs),
        })
    full = next((r for r in rows if r["method"] == "full"), None)
    for r in rows:
        r["agreement"] = _agreement(store, cases, r["method"], r["budget"]) if full else None
        r["retention"] = None
        if full is not None and full["average"]:
            r["retention"] = r["average"] / full["average"] if r["average"] is not None else None
        for cat, v in r["categories"].items():
            f = full["categories"][cat]["accuracy"] if full else None
            v["retention"] = v["accuracy"] / f if f and v["accuracy"] is not None else None
    complete = all(r["n"] == len(cases) for r in rows)
    # cases no method ran (too long for the model's context: eval.sizing); never scored for any
    skipped = [s.line() for s in load_skipped(store.dir)]
    return {"categories": categories, "n_cases": len(cases), "complete": complete, "runs": rows, "skipped": skipped}


def _agreement(store: ResultStore, cases: list[Case], method: str, budget: float | None) -> float | None:
    """Share of cases (run by both) where ``method`` wrote exactly Full KV's output."""
    same = n = 0
    for c in cases:
        r = store.records.get((c.id, method, budget_key(budget)))
        f = store.records.get((c.id, "full", budget_key(None)))
        if r is not None and f is not None:
            n += 1
            same += r["output"] == f["output"]
    return same / n if n else None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def num(x: float | None, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _has_fidelity(summary: dict[str, Any]) -> bool:
    return any(r.get("fidelity") for r in summary["runs"])


def fidelity_cells(f: dict[str, Any] | None) -> list[str]:
    """A run's pooled fidelity as table cells: KL, top-1 %, gold NLL, gold dNLL."""
    if not f:
        return ["-"] * 4
    return [num(f["kl"]), _pct(f["top1"]), num(f["gold_nll"], ".3f"), num(f["gold_dnll"], "+.3f")]


def markdown(summary: dict[str, Any]) -> str:
    cats = summary["categories"]
    fid = _has_fidelity(summary)
    head = ["method", *cats, "average", *(["KL", "top-1 %", "gold NLL", "gold dNLL"] if fid else []),
            "retention", "same as full", "cases", "time (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["runs"]:
        cells = [r["label"], *(_pct(r["categories"][c]["accuracy"]) for c in cats), _pct(r["average"]),
                 *(fidelity_cells(r.get("fidelity")) if fid else []),
                 "-" if r["retention"] is None else f"{r['retention']:.3f}", _pct(r.get("agreement")), str(r["n"]),
                 f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    counts = ", ".join(f"{c}: {summary['runs'][0]['categories'][c]['n']}" for c in cats) if summary["runs"] else ""
    lines += ["", f"Accuracy in % (BFCL AST checker); average = mean over categories; retention = average / "
              f"Full-KV average; same as full = % of cases whose output equals Full KV's exactly. "
              f"Cases per category: {counts}."]
    if fid:
        lines += ["", *fidelity_markdown(summary)]
    if summary.get("skipped"):
        lines += ["", f"Skipped for every method ({len(summary['skipped'])}):", "",
                  *(f"- {line}" for line in summary["skipped"])]
    return "\n".join(lines) + "\n"


def fidelity_markdown(summary: dict[str, Any]) -> list[str]:
    """The per-class fidelity table and its legend (runs with a fidelity summary)."""
    runs = [r for r in summary["runs"] if r.get("fidelity")]
    groups = [g for g in GROUP_NAMES if any(g in r["fidelity"]["groups"] for r in runs)]  # classes seen
    head = ["method", *(f"KL {g}" for g in groups), *(f"top-1 {g} %" for g in groups), "steps", "gold cases"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        f = r["fidelity"]
        per = [f["groups"].get(g) or {} for g in groups]
        cells = [r["label"], *(num(p.get("kl")) for p in per), *(_pct(p.get("top1")) for p in per),
                 str(f["n"]), str(f["gold_cases"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Fidelity (teacher-forced along Full KV's own output, `--fidelity`): KL = mean KL(Full || method) "
              "per generated token (nats; Full's top-128 tokens + the rest pooled); top-1 % = steps where the "
              "method's own constrained greedy choice is Full KV's token; gold NLL = mean NLL per token of the "
              "gold call forced under the method, gold dNLL = minus Full KV's on the same cases. Per class: "
              "name = function name, key = argument keys, value = values, punct = punctuation and whitespace, "
              "end = the end-of-generation step."]
    full = next((r.get("fidelity") for r in summary["runs"] if r["budget"] is None), None)
    if full and full.get("same_output") is not None:
        lines[-1] += (f" Full KV's reference (the engine's full path) writes the Full KV row's output in "
                      f"{_pct(full['same_output'])}% of its cases.")
    return lines


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_method: dict[str, list[tuple[float, float]]] = {}
    for r in summary["runs"]:
        if r["average"] is None:
            continue
        if r["budget"] is None:
            ax.axhline(100 * r["average"], linestyle="--", color="black", label=f"{r['method']} (100% KV)")
        else:
            by_method.setdefault(r["method"], []).append((r["budget"], 100 * r["average"]))
    for method, pts in by_method.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xlabel("KV budget (fraction of full cache)")
    ax.set_ylabel("accuracy, mean over categories (%)")
    ax.set_title(f"BFCL AST accuracy ({summary['n_cases']} cases)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fidelity(summary: dict[str, Any], path: Path) -> None:
    """Mean KL, top-1 agreement and gold dNLL against the budget, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("kl", "KL(Full || method), nats/token", 1.0), ("top1", "top-1 agreement with Full KV (%)", 100.0),
              ("gold_dnll", "gold call dNLL vs Full KV (nats/token)", 1.0))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.0))
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        by_method: dict[str, list[tuple[float, float]]] = {}
        for r in summary["runs"]:
            f = r.get("fidelity")
            if f and f.get(key) is not None and r["budget"] is not None:
                by_method.setdefault(r["method"], []).append((r["budget"], scale * f[key]))
        for method, pts in by_method.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("KV budget (fraction of full cache)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"Fidelity to Full KV, teacher-forced ({summary['n_cases']} cases)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(store: ResultStore, cases: list[Case], runs: list[tuple[str, float | None]]) -> dict[str, Any]:
    summary = summarize(store, cases, runs)
    (store.dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    (store.dir / TABLE_FILE).write_text(markdown(summary))
    plot(summary, store.dir / PLOT_FILE)
    if _has_fidelity(summary):
        plot_fidelity(summary, store.dir / FIDELITY_PLOT_FILE)
    return summary
