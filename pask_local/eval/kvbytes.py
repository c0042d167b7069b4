"""K/V bytes of a study's runs as a share of Full KV's f16 cache for the same requests.

The issue's memory goal is stated against Full KV at f16 ("PASK x q8_0 at <= 0.18x of Full's f16 K/V
bytes"), so every run, whatever its element type, is divided by the same denominator: the f16 cache
a Full KV context sized for the request allocates (``n_prompt + max_tokens + 1`` cells rounded up
to the cell alignment, as the engine sizes a full context and upstream pads ``n_ctx``).

A budgeted run's record holds what its layered cache allocated (``kv_bytes_allocated``) and, of
that, the bytes added by rounding each layer's capacity up to the alignment
(``kv_bytes_alignment``). Two shares are reported, summed over the cases: *allocated* (both sides
rounded) and *before rounding* (the run's bytes less its rounding over Full's unrounded cells).
Both are the allocation, i.e. the peak: a method that prefills the whole prompt before it
compresses (SnapKV, pask-hybrid) allocates every prompt cell. A third share is what the run *holds*
at the end: its entries (``budget_used_final`` of Full KV's prompt + answer) at its element type's
bytes per entry, over Full f16's bytes for the same entries. A run decoded from a shared prefill
(``shared_prefill`` in its stats: eval's one prefill for several compressing methods) recorded its
part of one stream that every method's cells share, not what it allocates alone: its allocation is
left out (``None``), its held share is kept. A Full KV run's own record holds no
byte count (the eval sizes its context once for the longest case); its row is Full KV for the
request at the run's element type, measured the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .study import Key, StudyError, run_label, run_order

# bytes of Full KV's cache for a context of n cells (a multiple of the alignment) and element type
FullBytes = Callable[[int, str], int]


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def kv_bytes(records: dict[Key, dict[str, Any]], ids: Sequence[str], kv_type: str, full_bytes: FullBytes,
             max_tokens: int, align: int = 256) -> list[dict[str, Any]]:
    """Per run of ``records`` (all made with K/V element type ``kv_type``) on the cases ``ids``: mean
    allocated bytes, and the allocated and before-rounding shares of Full KV f16's bytes."""
    per_cell_f16 = full_bytes(align, "f16") / align
    if full_bytes(2 * align, "f16") != 2 * full_bytes(align, "f16"):
        per_cell_f16 = None  # a model whose cache does not grow with the context (sliding windows)
    per_entry = full_bytes(align, kv_type) / full_bytes(align, "f16")  # the element type's bytes per f16 byte
    runs = sorted({(m, b) for (i, m, b) in records if i in set(ids)}, key=run_order)
    rows = []
    for run in runs:
        alloc = unrounded = full_alloc = full_unrounded = held = entries = 0.0
        shared = False
        for i in ids:
            r = records.get((i, *run))
            if r is None:
                raise StudyError(f"{run_label(*run)} has no record of case {i}")
            st = r.get("stats") if isinstance(r.get("stats"), dict) else {}
            n_prompt = st.get("n_prompt", r.get("n_prompt"))
            if not isinstance(n_prompt, int):
                raise StudyError(f"{run_label(*run)}: case {i} recorded no prompt length")
            cells = n_prompt + max_tokens + 1
            f16 = full_bytes(round_up(cells, align), "f16")
            full_alloc += f16
            full_unrounded += cells * per_cell_f16 if per_cell_f16 is not None else f16
            n_all = n_prompt + int(st.get("n_gen", r.get("n_generated", 0)) or 0)
            entries += n_all
            held += n_all * (1.0 if run[0] == "full" else float(st.get("budget_used_final", 1.0)))
            if run[0] == "full":
                mine = full_bytes(round_up(cells, align), kv_type)
                alloc += mine
                unrounded += mine * cells / round_up(cells, align)
            elif st.get("shared_prefill"):
                shared = True
            else:
                if not isinstance(st.get("kv_bytes_allocated"), int):
                    raise StudyError(f"{run_label(*run)}: case {i} recorded no K/V bytes")
                alloc += st["kv_bytes_allocated"]
                unrounded += st["kv_bytes_allocated"] - st.get("kv_bytes_alignment", 0)
        rows.append({"label": run_label(*run), "method": run[0], "budget": None if run[1] == "full" else float(run[1]),
                     "kv_type": kv_type, "n": len(ids), "shared_prefill": shared,
                     "mean_bytes": None if shared else alloc / len(ids),
                     "share_of_full_f16": None if shared else alloc / full_alloc,
                     "share_before_rounding": None if shared or per_cell_f16 is None else unrounded / full_unrounded,
                     "held_share_of_full_f16": per_entry * held / entries if entries else None})
    return rows


def markdown(rows: Sequence[dict[str, Any]], accuracy: dict[tuple[str, str], tuple[float, float | None]]) -> str:
    """One table: run, element type, mean MB, the three shares of Full f16, accuracy and retention."""
    lines = ["| run | K/V type | cases | mean K/V MB allocated | allocated / Full f16 | before 256-rounding | "
             "held at the end / Full f16 | accuracy % | retention of Full f16 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc, ret = accuracy.get((r["label"], r["kv_type"]), (None, None))
        mb = "shared prefill" if r["mean_bytes"] is None else f"{r['mean_bytes'] / 1e6:.2f}"
        lines.append(f"| {r['label']} | {r['kv_type']} | {r['n']} | {mb} | {_num(r['share_of_full_f16'])} | "
                     f"{_num(r['share_before_rounding'])} | {_num(r['held_share_of_full_f16'])} | "
                     + ("-" if acc is None else f"{100 * acc:.1f}") + " | "
                     + ("-" if ret is None else f"{ret:.3f}") + " |")
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
