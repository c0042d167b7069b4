"""K/V bytes of a study's runs as a share of Full KV's f16 cache for the same requests.

The issue's memory goal is stated against Full KV at f16 ("PASK x q8_0 at <= 0.18x of Full's f16 K/V
bytes"), so every run, whatever its element type, is divided by Full KV f16 on the same cases:

- *allocated*: the run's cache over the f16 cache a Full KV context sized for the request allocates
  (``n_prompt + max_tokens + 1`` cells rounded up to the cell alignment, as the engine sizes a full
  context and upstream pads ``n_ctx``). A budgeted run's record holds what its layered cache
  allocated (``kv_bytes_allocated``); this is its peak: a method that prefills the whole prompt
  before it compresses (SnapKV, pask-hybrid) allocates every prompt cell.
- *before rounding*: the same less the bytes added by rounding each layer's capacity up to the
  alignment (``kv_bytes_alignment``), over Full's unrounded cells.
- *held*: the entries the run keeps at the end (``budget_used_final``, the share of its own
  sequence's entries) at its element type's bytes per entry, over Full f16 holding the same
  entries. The denominator is the sequence, not Full's rounded allocation.

A run decoded from a shared prefill (``shared_prefill`` in its stats: eval's one prefill for several
compressing methods) recorded its part of one stream that every method's cells share, not what it
allocates alone: its allocation is left out (``None``), its held share is kept. A Full KV run's
record holds no byte count (the eval's Full KV context has the fixed ``--n-ctx``); its row is Full
KV sized for the request at the run's element type, measured the same way. Sums run over the
cases, so long prompts weigh more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .study import Key, StudyError, run_label, run_order

# bytes of Full KV's cache for a context of n cells (a multiple of the alignment) and element type
FullBytes = Callable[[int, str], int]


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _share(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and 0.0 <= x <= 1.5


def _case_numbers(run: tuple[str, str], case: str, r: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """(prompt tokens, generated tokens, engine stats) of one record, or a StudyError saying what is wrong."""
    where = f"{run_label(*run)}: case {case}"
    if r.get("error_type") == "generation_error":
        raise StudyError(f"{where} failed to generate ({str(r.get('error'))[:120]}): no K/V to count")
    st = r.get("stats") if isinstance(r.get("stats"), dict) else {}
    n_prompt = st.get("n_prompt", r.get("n_prompt"))
    n_gen = st.get("n_gen", r.get("n_generated"))
    if not _count(n_prompt) or n_prompt == 0 or not _count(n_gen):
        raise StudyError(f"{where} recorded no prompt or answer length")
    return n_prompt, n_gen, st


def kv_bytes(records: dict[Key, dict[str, Any]], ids: Sequence[str], kv_type: str, full_bytes: FullBytes,
             max_tokens: int, align: int = 256) -> list[dict[str, Any]]:
    """Per run of ``records`` (all made with K/V element type ``kv_type``) on the cases ``ids``: mean
    allocated bytes, the allocated, before-rounding and held shares of Full KV f16 (the module's
    docstring), and ``shared_prefill`` (the allocation is not the run's own: ``None``)."""
    per_cell_f16: float | None = full_bytes(align, "f16") / align
    if full_bytes(2 * align, "f16") != 2 * full_bytes(align, "f16"):
        per_cell_f16 = None  # a model whose cache does not grow with the context (sliding windows)
    per_entry = full_bytes(align, kv_type) / full_bytes(align, "f16")  # the element type's bytes per f16 byte
    wanted = set(ids)
    runs = sorted({(m, b) for (i, m, b) in records if i in wanted}, key=run_order)
    rows = []
    for run in runs:
        alloc = unrounded = full_alloc = full_unrounded = held = entries = 0.0
        shared = False
        for i in ids:
            r = records.get((i, *run))
            if r is None:
                raise StudyError(f"{run_label(*run)} has no record of case {i}")
            n_prompt, n_gen, st = _case_numbers(run, i, r)
            # the sequence the budget is measured on: the last generated token is never decoded into the cache
            n_seq = n_prompt + max(n_gen - 1, 0)
            entries += n_seq
            cells = n_prompt + max_tokens + 1
            full_alloc += full_bytes(round_up(cells, align), "f16")
            if per_cell_f16 is not None:
                full_unrounded += cells * per_cell_f16
            if run[0] == "full":
                held += n_seq
                mine = full_bytes(round_up(cells, align), kv_type)
                alloc += mine
                unrounded += mine * cells / round_up(cells, align)
                continue
            used = st.get("budget_used_final")
            if not _share(used):
                raise StudyError(f"{run_label(*run)}: case {i} recorded no final K/V share")
            held += n_seq * used
            if st.get("shared_prefill"):
                shared = True
                continue
            a, rounding = st.get("kv_bytes_allocated"), st.get("kv_bytes_alignment", 0)
            if not _count(a) or not _count(rounding) or rounding > a:
                raise StudyError(f"{run_label(*run)}: case {i} recorded no K/V bytes")
            alloc += a
            unrounded += a - rounding
        rows.append({"label": run_label(*run), "method": run[0], "budget": None if run[1] == "full" else float(run[1]),
                     "kv_type": kv_type, "n": len(ids), "shared_prefill": shared,
                     "mean_bytes": None if shared else alloc / len(ids),
                     "share_of_full_f16": None if shared else alloc / full_alloc,
                     "share_before_rounding": None if shared or per_cell_f16 is None else unrounded / full_unrounded,
                     "held_share_of_full_f16": per_entry * held / entries if entries else None})
    return rows


def markdown(rows: Sequence[dict[str, Any]], accuracy: dict[tuple[str, str], tuple[float, float | None]],
             align: int = 256) -> str:
    """One table: run, element type, mean MB, the three shares of Full f16, accuracy and retention."""
    lines = [f"| run | K/V type | cases | mean K/V MB allocated | allocated / Full f16 allocated | "
             f"before {align}-cell rounding | held / Full f16 holding the same entries | accuracy % | "
             "retention of Full f16 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc, ret = accuracy.get((r["label"], r["kv_type"]), (None, None))
        mb = "shared prefill" if r["mean_bytes"] is None else f"{r['mean_bytes'] / 1e6:.2f}"
        lines.append(f"| {r['label']} | {r['kv_type']} | {r['n']} | {mb} | {_num(r['share_of_full_f16'])} | "
                     f"{_num(r['share_before_rounding'])} | {_num(r['held_share_of_full_f16'])} | "
                     f"{_num(acc, 100, '.1f')} | {_num(ret)} |")
    return "\n".join(lines) + "\n"


def _num(x: float | None, scale: float = 1.0, fmt: str = ".3f") -> str:
    return "-" if x is None else format(scale * x, fmt)
