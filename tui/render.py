"""Turns a replay and the view state into Rich text: token stream, heatmap, step line, side panel, legend.

Pure functions (no Textual) so what each widget shows can be checked directly; the widgets in
``widgets.py`` only place these texts on screen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.cells import cell_len
from rich.console import Group as RGroup
from rich.table import Table
from rich.text import Text

from pask_local.classes import StructuralClass

from .replay import CLASSES, Replay
from .style import breaks_line, colour, display_text, heat, short
from .trace import Header

FILTERED_OUT = "#3a3a3a"


@dataclass
class ViewState:
    """What the user selected; shared by every pane (clamped to each trace)."""

    step: int = 10**9          # clamped to the last step: open on the final state
    group: int = 0
    cursor: int = 0
    only: StructuralClass | None = None
    query: str = ""
    layer_rows: bool = False
    zoom: bool = False


@dataclass
class PaneView:
    """The state resolved against one trace.

    ``ended``: the shared step lies past this trace's last step (compare mode, a shorter trace), so
    the pane holds its own final step."""

    replay: Replay
    step: int
    group: int
    cursor: int
    ended: bool = False

    @classmethod
    def resolve(cls, replay: Replay, state: ViewState) -> PaneView:
        step = replay.clamp(state.step)
        return cls(replay=replay, step=step, group=min(state.group, len(replay.groups) - 1),
                   cursor=max(0, min(state.cursor, replay.n_pos - 1)),
                   ended=state.step > step and replay.trace.complete)


def run_label(header: Header) -> str:
    """``pask · budget 0.33``, or ``full KV (no budget)`` for a full-KV run (its header has no budget)."""
    return "full KV (no budget)" if header.budget is None else f"{header.method} · budget {header.budget:.2f}"


def group_label(replay: Replay, g: int) -> str:
    layers = replay.groups[g]
    span = f"L{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else \
        "L" + ",".join(map(str, layers))
    return f"g{g} ({span})"


def step_label(step: int) -> str:
    return "prefill" if step < 0 else f"step {step}"


def matches(replay: Replay, query: str) -> list[int]:
    """Positions whose token text contains ``query`` (case-insensitive)."""
    if not query:
        return []
    q = query.lower()
    return [t.pos for t in replay.trace.tokens if q in t.text.lower()]


# --------------------------------------------------------------- tokens
@dataclass
class TokenLayout:
    text: Text
    line_of: list[int]          # row of each position (-1: hidden)
    status: dict[int, str]      # position -> "held" | "partial" | "evicted" | "future" (shown ones)
    spans: dict[int, tuple[int, int, str]]  # position -> (start, end, style) in ``text``
    cells: dict[int, tuple[int, int, int]]  # position -> (row, first column, end column) on screen

    def pos_at(self, x: int, y: int) -> int | None:
        """The position shown at cell (x, y) of the text, if any."""
        for p, (row, a, b) in self.cells.items():
            if row == y and a <= x < b:
                return p
        return None


def token_stream(view: PaneView, state: ViewState, width: int) -> TokenLayout:
    """The token stream wrapped to ``width`` cells, each token styled by class and retention."""
    r = view.replay
    width = max(8, width)
    counts = r.group_counts(view.step)[view.group]
    n_layers = len(r.groups[view.group])
    n_seq = r.n_seq(view.step)
    changes = r.changes(view.step, view.group)
    left_now = {e.pos for e in changes.evicted if e.left_group}
    hits = set(matches(r, state.query))
    text = Text(no_wrap=True, overflow="crop")
    line_of = [-1] * r.n_pos
    status: dict[int, str] = {}
    spans: dict[int, tuple[int, int, str]] = {}
    cells: dict[int, tuple[int, int, int]] = {}
    row, col = 0, 0
    for tok in r.trace.tokens:
        p = tok.pos
        if p >= n_seq and view.step < r.last_step:
            continue  # not generated yet at this step
        if p >= n_seq:
            st = "future"   # generated but never decoded into the cache (the token that ended the call)
        elif counts[p] == n_layers:
            st = "held"
        elif counts[p] > 0:
            st = "partial"
        else:
            st = "evicted"
        status[p] = st
        shown = display_text(tok.text)
        w = cell_len(shown)
        if col and col + w > width:
            text.append("\n")
            row, col = row + 1, 0
        style = colour(tok.cls) if state.only is None or tok.cls == state.only else FILTERED_OUT
        if st == "partial":
            style += " dim"
        elif st == "evicted":
            style += " dim strike"
        elif st == "future":
            style += " italic dim"
        if p == changes.added:
            style += " bold underline"
        if p in left_now:
            style += " on #5f0000"
        elif p in hits:
            style += " on #5f5f00"
        if p == view.cursor:
            style += " reverse"
        line_of[p] = row
        spans[p] = (len(text), len(text) + len(shown), style)
        cells[p] = (row, col, col + w)
        text.append(shown, style=style)
        col += w
        if breaks_line(tok.text):
            text.append("\n")
            row, col = row + 1, 0
    return TokenLayout(text=text, line_of=line_of, status=status, spans=spans, cells=cells)


# -------------------------------------------------------------- heatmap
@dataclass
class HeatLayout:
    text: Text
    first: int                # first position shown
    per_col: int              # positions per column
    label_w: int
    rows: list[int]           # group index of each row (its layer's group in layer mode)

    def pos_at(self, x: int) -> int | None:
        if x < self.label_w:
            return None
        return self.first + (x - self.label_w) * self.per_col


def heatmap(view: PaneView, state: ViewState, width: int, max_rows: int = 64) -> HeatLayout:
    """Groups (or layers) x positions; colour = fraction of entries held; ▼ marks the cursor.

    Layer rows that do not fit in ``max_rows`` are limited to the selected group's layers."""
    r = view.replay
    label_w = 4
    cols = max(4, width - label_w)
    held = r.layer_held(view.step).astype(np.float32)           # [n_layer, n_pos]
    present = r.present(view.step)
    if state.only is not None:
        present = present & (r.classes == CLASSES.index(state.only))
    if state.layer_rows:
        layers = range(r.n_layer) if r.n_layer <= max_rows else r.groups[view.group]
        rows = [(f"L{il}", held[il], r.trace.header.group_of(il)) for il in layers]
    else:
        rows = [(f"g{g}", held[layers].mean(axis=0), g) for g, layers in enumerate(r.groups)]
    if state.zoom or r.n_pos <= cols:
        per_col = 1
        first = max(0, min(view.cursor - cols // 2, r.n_pos - cols)) if r.n_pos > cols else 0
    else:
        per_col = -(-r.n_pos // cols)
        first = 0
    n_cols = min(cols, -(-(r.n_pos - first) // per_col))
    text = Text(no_wrap=True, overflow="crop")
    cur_col = (view.cursor - first) // per_col
    ruler = [" "] * n_cols
    if 0 <= cur_col < n_cols:
        ruler[cur_col] = "▼"
    text.append(f"{first:<{label_w}}"[:label_w], style="dim")
    text.append("".join(ruler), style="bold")
    for label, frac, g in rows:
        text.append("\n")
        text.append(f"{label:<{label_w}}", style="reverse" if g == view.group else "")
        for c in range(n_cols):
            a = first + c * per_col
            b = min(r.n_pos, a + per_col)
            m = present[a:b]
            if not m.any():
                text.append("·", style="#444444")
                continue
            f = float(frac[a:b][m].mean())
            text.append("█", style=heat(f) + (" reverse" if c == cur_col else ""))
    return HeatLayout(text=text, first=first, per_col=per_col, label_w=label_w, rows=[g for _, _, g in rows])


# ---------------------------------------------------------- step + cursor
def step_info(view: PaneView, state: ViewState, width: int) -> Text:
    """Slider line, what this step added/evicted in the group and by which rule, the cursor token."""
    r = view.replay
    last = r.last_step
    text = Text(no_wrap=True, overflow="ellipsis")
    label = f"{step_label(view.step)}/{last}" if last >= 0 else "prefill (no steps)"
    if view.ended:
        label += " (ended)"
    label = f"{label:<13} "
    text.append(label, style="bold")
    bar_w = max(4, width - len(label))
    span = last + 1
    knob = round((view.step + 1) / span * (bar_w - 1)) if span > 0 else 0
    text.append("━" * knob, style="#2e8b57")
    text.append("●", style="bold")
    text.append("─" * (bar_w - knob - 1), style="#444444")
    text.append("\n")
    ch = r.changes(view.step, view.group)
    if ch.added is not None:
        tok = r.trace.tokens[ch.added]
        text.append(f"+{ch.added} ", style="bold")
        text.append(display_text(tok.text)[:16], style=colour(tok.cls))
        text.append(f" {short(tok.cls)}  ")
    else:
        text.append(f"prompt {r.n_prompt} tok  ")
    left = sum(1 for e in ch.evicted if e.left_group)
    text.append(f"g{view.group} −{left}", style="bold")
    if ch.evicted:
        rules = ", ".join(f"{k} {v}" for k, v in sorted(ch.rule_counts().items()))
        text.append(f" ({rules})")
    text.append("\n")
    text.append_text(cursor_info(view))
    return text


def cursor_info(view: PaneView) -> Text:
    """The cursor token: class, and for each group whether it is held, or when and why it left."""
    r = view.replay
    if r.n_pos == 0:
        return Text("")
    p = view.cursor
    tok = r.trace.tokens[p]
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"@{p} ", style="bold")
    text.append(display_text(tok.text)[:14], style=colour(tok.cls) + " reverse")
    text.append(f" {short(tok.cls)} ")
    if p >= r.n_seq(view.step):
        text.append("not in cache yet" if p < r.n_seq(r.last_step) else "never cached", style="italic")
        return text
    counts = r.group_counts(view.step)[:, p]
    for g, layers in enumerate(r.groups):
        mark = "✓" if counts[g] == len(layers) else ("½" if counts[g] else "✗")
        style = "bold" if g == view.group else ""
        text.append(f" g{g}{mark}", style=style)
        if mark != "✓":
            steps = r.evict_step[layers, p]
            first = int(steps.min())
            rule = r.rules[int(r.evict_rule[layers[int(steps.argmin())], p])]
            text.append(f"({step_label(first).replace('step ', 's')} {rule})", style=style + " dim")
    return text


# ----------------------------------------------------------- side panel
def side_panel(view: PaneView, state: ViewState) -> RGroup:
    """Method, model, budget used vs budget, per-class kept/total with the policy's floor and weight."""
    r = view.replay
    h = r.trace.header
    head = Text()
    head.append(run_label(h), style="bold")
    head.append("\n")
    head.append(f"{h.model}\n", style="dim")
    used = r.budget_used(view.step)
    head.append("KV used ")
    if h.budget is None:
        head.append(f"{used:.3f}", style="bold")
        head.append(" (no budget)\n")
    else:
        over = used / h.budget
        head.append(f"{used:.3f}", style="bold green" if over <= 1 + 1e-9 else
                    ("bold yellow" if over <= 1.05 else "bold red"))
        head.append(f" / budget {h.budget:.2f}\n")
    bar_w = 24
    fill = min(bar_w, round(used * bar_w))
    mark = -1 if h.budget is None else min(bar_w - 1, round(h.budget * bar_w))
    bar = Text()
    for i in range(bar_w):
        bar.append("│" if i == mark else ("█" if i < fill else "░"), style="#2e8b57" if i < fill else "#444444")
    head.append_text(bar)
    head.append("\n")
    kept = r.kept_per_group(view.step)
    n = r.n_seq(view.step)
    for g, layers in enumerate(r.groups):
        pct = kept[g] / (n * len(layers)) if n else 0.0
        head.append(f"g{g} {kept[g]:>5}/{n * len(layers):<5} {pct:4.0%}\n",
                    style="bold reverse" if g == view.group else "")
    if h.policy:
        head.append(f"policy: {h.policy.get('kind', '?')}", style="dim")
    else:
        head.append("policy: none (baseline)", style="dim")
    table = Table(box=None, padding=(0, 1, 0, 0), show_edge=False, header_style="bold",
                  title=f"{group_label(r, view.group)} @ {step_label(view.step)}", title_justify="left")
    table.add_column("class")
    table.add_column("kept", justify="right")
    if h.policy:
        table.add_column("fl", justify="right")
        table.add_column("w", justify="right")
    for st in r.class_stats(view.step, view.group):
        label = Text(short(st.cls), style=colour(st.cls) + (" reverse" if st.cls == state.only else ""))
        kept_s = f"{st.kept}/{st.total}" + (f"+{st.partial}" if st.partial else "")
        row = [label, kept_s]
        if h.policy:
            fl, w = r.policy_row(view.group, st.cls)
            row += ["-" if fl is None else f"{fl:.2g}", "-" if w is None else f"{w:.2g}"]
        table.add_row(*row)
    out = [head, table]
    fin = r.trace.final
    if fin is not None:
        out.append(Text(f"output {'valid' if fin.valid else 'INVALID'} · {fin.ms_per_token:.1f} ms/tok",
                        style="green" if fin.valid else "red"))
    else:
        out.append(Text("running…", style="yellow"))
    return RGroup(*out)


def pane_title(view: PaneView, state: ViewState) -> Text:
    """One line per pane (compare mode): method, group, kept positions, KV used vs budget (or no budget)."""
    r = view.replay
    h = r.trace.header
    held = int(r.group_held(view.step, view.group)[: r.n_seq(view.step)].sum())
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f" {h.method} ", style="bold reverse")
    kv = "no budget" if h.budget is None else f"KV {r.budget_used(view.step):.2f}/{h.budget:.2f}"
    t.append(f" g{view.group} {held}/{r.n_seq(view.step)} pos · {kv}")
    if state.only is not None:
        t.append(f" · only {short(state.only)}", style="bold")
    return t


def legend(classes: list[StructuralClass]) -> Text:
    t = Text()
    for c in classes:
        t.append("■", style=colour(c))
        t.append(f"{short(c)} ")
    t.append(" held ")
    t.append("dim", style="dim")
    t.append("=partial ")
    t.append("struck", style="dim strike")
    t.append("=evicted")
    return t
