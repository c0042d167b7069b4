"""Does Full KV's answer fit in the budget? A study's cases split by whether a cache of the budget's
size can hold the call Full KV generates, with every run's accuracy on both parts.

A method at budget ``b`` holds about ``b * (n_prompt + n_gen)`` entries per layer at the end of a
case (the budget counts generated tokens too). When Full KV's own answer is longer than that
(``n_gen > b * (n_prompt + n_gen)``, i.e. the answer is more than ``b`` of the sequence), every
method must evict part of the call it is writing, whatever it keeps of the prompt: on those cases
no choice of prompt entries can give Full KV's output. The split says how much of a budget's
accuracy gap is of that kind. Lengths: ``n_prompt`` from any run's record of the case (the prompt is
the same for every method), ``n_gen`` Full KV's generated text tokenized again. A case no run
prefilled (every run failed before the prompt, e.g. a tool schema the grammar compiler rejects) has
no length: it is left out of the split and listed under ``left_out``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .study import Key, StudyError, run_label, run_order

Lengths = dict[str, tuple[int, int]]  # case id -> (prompt tokens, Full KV's generated tokens)


def answer_lengths(records: dict[Key, dict[str, Any]], ids: Sequence[str],
                   tokenize: Callable[[str], list[int]]) -> Lengths:
    """(n_prompt, n_gen) per case: the prompt length any run recorded, Full KV's output re-tokenized.

    Cases no run prefilled are absent from the result (see ``left_out``)."""
    n_prompt: dict[str, int] = {}
    for (i, _, _), r in records.items():
        n = _prompt_length(r)
        if n:
            n_prompt.setdefault(i, n)
    out: Lengths = {}
    for i in ids:
        full = records.get((i, "full", "full"))
        if full is None:
            raise StudyError(f"case {i} has no Full KV record")
        if i not in n_prompt:
            continue
        text = (full.get("stats") or {}).get("raw_output", full["output"])
        out[i] = (n_prompt[i], len(tokenize(text)))
    return out


def _prompt_length(record: dict[str, Any]) -> int:
    """The prompt tokens a record says were prefilled (0 when the run failed before the prompt)."""
    st = record.get("stats")
    for n in (st.get("n_prompt") if isinstance(st, dict) else None, record.get("n_prompt")):
        if isinstance(n, int) and n > 0:
            return n
    return 0


def fits(n_prompt: int, n_gen: int, budget: float) -> bool:
    """Whether Full KV's answer is at most ``budget`` of the case's whole sequence."""
    return n_gen <= budget * (n_prompt + n_gen)


def headroom(records: dict[Key, dict[str, Any]], lengths: Lengths,
             left_out: Sequence[str] = ()) -> dict[str, Any]:
    """Per budget: the cases whose answer fits and the rest, each run's cases right on both parts.

    ``left_out``: the study's cases without a length (no run prefilled them), reported, not split."""
    ids = sorted(lengths)
    if not ids:
        raise StudyError("no case of the study was prefilled by any run: nothing to split")
    runs = sorted({(m, b) for (_, m, b) in records}, key=run_order)
    budgets = sorted({b for (_, b) in runs if b != "full"}, key=float, reverse=True)

    def right(run: tuple[str, str], part: list[str]) -> int:
        return sum(1 for i in part if (i, *run) in records and records[(i, *run)]["valid"])

    per_budget = []
    for b in budgets:
        fit = [i for i in ids if fits(*lengths[i], float(b))]
        rest = [i for i in ids if not fits(*lengths[i], float(b))]
        rows = [{"label": run_label(*r), "method": r[0], "fit_right": right(r, fit), "rest_right": right(r, rest)}
                for r in runs if r[1] in (b, "full")]
        per_budget.append({"budget": float(b), "fit": len(fit), "rest": len(rest), "runs": rows,
                           "rest_by_category": _by_category(records, rest)})
    gen_share = [g / (p + g) for p, g in lengths.values() if p + g]
    return {"n_cases": len(ids), "mean_prompt": sum(p for p, _ in lengths.values()) / len(ids),
            "mean_gen": sum(g for _, g in lengths.values()) / len(ids),
            "mean_gen_share": sum(gen_share) / len(gen_share), "budgets": per_budget,
            "left_out": sorted(left_out),
            "lengths": {i: list(v) for i, v in sorted(lengths.items())}}


def _by_category(records: dict[Key, dict[str, Any]], ids: list[str]) -> dict[str, int]:
    return dict(sorted(Counter(records[(i, "full", "full")]["category"] for i in ids).items()))


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.0f}%)" if n else "-"


def markdown(h: dict[str, Any]) -> str:
    """One table per budget: cases right where Full KV's answer fits the budget and where it does not."""
    lines = [f"{h['n_cases']} cases; mean prompt {h['mean_prompt']:.0f} tokens, Full KV's answer {h['mean_gen']:.0f} "
             f"tokens ({100 * h['mean_gen_share']:.0f}% of the sequence on average). A case's answer *fits* budget "
             "b when it is at most b of the sequence (prompt + answer).", ""]
    if h.get("left_out"):
        lines[0] += (f" Left out: {len(h['left_out'])} case(s) no run prefilled "
                     f"(every run failed before the prompt): {', '.join(h['left_out'])}.")
    for b in h["budgets"]:
        cats = ", ".join(f"{c} {n}" for c, n in b["rest_by_category"].items()) or "none"
        lines += [f"Budget {b['budget']:g}: the answer fits in {b['fit']} cases, not in {b['rest']} ({cats}).", "",
                  "| run | right where it fits | right where it does not |", "|---|---|---|"]
        for r in b["runs"]:
            lines.append(f"| {r['label']} | {_pct(r['fit_right'], b['fit'])} | {_pct(r['rest_right'], b['rest'])} |")
        lines.append("")
    return "\n".join(lines)
