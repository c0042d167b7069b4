"""The trace viewer app: one trace (with side panel) or two side by side (compare mode).

The app owns the ``ViewState`` (step, group, cursor, class filter, search) and re-renders every
pane on each change. A live run feeds lines through ``LiveFeed`` objects polled on a timer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from .render import ViewState, legend, matches, run_label
from .replay import CLASSES, Replay
from .trace import Trace
from .widgets import CursorTo, SidePanel, TracePane

HELP = """\
[b]pask-local tui[/b]: which tokens' KV entries persist in which layer group

[b]Replay[/b]  ←/→ previous/next step  PgUp/PgDn 10 steps  Home/End prefill/last
        compare: End = the longer trace's end; a shorter pane shows "(ended)"
[b]Group[/b]   g/G next/previous group  1-9 group number
[b]Cursor[/b]  h/l previous/next token  j/k next/previous row
        (or click a token or a heatmap column)
[b]View[/b]    f/F only the next/previous class (cycles back to all classes)
        v heatmap rows: groups/layers  z zoom heatmap  s side panel
[b]Search[/b]  / search token text      n/N next/previous match
[b]Other[/b]   ? this help              q quit

Colours are structural classes (legend at the bottom). In the selected
group a token is plain when every layer holds it, [dim]dim[/dim] when some
layers dropped it, [dim strike]struck[/dim strike] when none holds it. Bold underlined:
added at this step; red background: left the group at this step.
Heatmap: green held, red evicted, · not in the cache yet. Cursor line:
per group ✓ held, ½ partly, ✗ evicted (step and rule that dropped it).
"""


KEYS = " ←→ step  g group  h/l cursor  f class  / search  v rows  ? help  q quit"


class LiveFeed(Protocol):
    """A trace still being written: ``poll()`` reads new lines, returns True when something arrived."""

    replay: Replay

    def poll(self) -> bool: ...

    @property
    def done(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help-text")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class TraceApp(App[None]):
    """``replays``: one trace, or two to compare. ``feeds``: live traces polled every 0.2 s."""

    CSS_PATH = "tui.tcss"
    AUTO_FOCUS = None
    TITLE = "pask-local tui"
    BINDINGS = [
        Binding("right", "step(1)", "step+", show=True),
        Binding("left", "step(-1)", "step-", show=True),
        Binding("pagedown", "step(10)", show=False),
        Binding("pageup", "step(-10)", show=False),
        Binding("end", "step_to(1000000000)", show=False),
        Binding("home", "step_to(-1)", show=False),
        Binding("g", "group(1)", "group", show=True),
        Binding("G", "group(-1)", show=False),
        Binding("h", "cursor(-1)", show=False),
        Binding("l", "cursor(1)", show=False),
        Binding("j", "row(1)", show=False),
        Binding("k", "row(-1)", show=False),
        Binding("f", "filter(1)", "class", show=True),
        Binding("F", "filter(-1)", show=False),
        Binding("v", "toggle_rows", show=False),
        Binding("z", "toggle_zoom", show=False),
        Binding("s", "toggle_side", show=False),
        Binding("slash", "search", "search", show=True),
        Binding("n", "next_match(1)", show=False),
        Binding("N", "next_match(-1)", show=False),
        Binding("question_mark", "help", "help", show=True),
        Binding("q", "quit", "quit", show=True),
        *[Binding(str(i), f"group_to({i - 1})", show=False) for i in range(1, 10)],
    ]

    def __init__(self, replays: list[Replay], feeds: list[LiveFeed] | None = None,
                 on_exit: Callable[[], None] | None = None) -> None:
        super().__init__()
        if not 1 <= len(replays) <= 2:
            raise ValueError("TraceApp shows one trace or two")
        self.replays = replays
        self.feeds = feeds or []
        self.state = ViewState()
        self._on_exit = on_exit
        self.compare = len(replays) == 2

    @classmethod
    def from_traces(cls, traces: list[Trace], **kwargs) -> TraceApp:
        return cls([Replay(t) for t in traces], **kwargs)

    # ------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        with Horizontal(id="body"):
            for i, r in enumerate(self.replays):
                yield TracePane(r, id=f"pane{i}")
            yield SidePanel(id="side")
        yield Static(id="legend")
        yield Input(placeholder="search token text (Enter: go, Esc: cancel)", id="search")
        yield Static(KEYS, id="keys")

    def on_mount(self) -> None:
        if self.compare:
            self.query_one("#side").display = False
            self.add_class("compare")
        if self.feeds:
            self.set_interval(0.2, self._poll_feeds)
        self.call_after_refresh(self.refresh_view)

    def on_resize(self) -> None:
        self.call_after_refresh(self.refresh_view)

    def on_unmount(self) -> None:
        if self._on_exit is not None:
            self._on_exit()

    # ------------------------------------------------------------- views
    @property
    def primary(self) -> Replay:
        return self.replays[0]

    @property
    def last_step(self) -> int:
        """The slider's end: the longest trace's last step (a shorter pane holds its own last step)."""
        return max(r.last_step for r in self.replays)

    def clamp(self, step: int) -> int:
        return max(-1, min(self.last_step, step))

    def refresh_view(self) -> None:
        s = self.state
        r = self.primary
        s.step = self.clamp(s.step)
        s.group = max(0, min(s.group, max(len(x.groups) for x in self.replays) - 1))
        s.cursor = max(0, min(s.cursor, max(x.n_pos for x in self.replays) - 1))
        views = [p.show(s) for p in self.query(TracePane)]
        side = self.query_one(SidePanel)
        if side.display:
            side.show(views[0], s)
        h = r.trace.header
        top = " " + " vs ".join(run_label(x.trace.header) for x in self.replays)
        top += f" · {h.model} · {r.n_prompt} prompt + {r.trace.n_gen} gen tokens"
        if s.query:
            top += f" · /{s.query} ({len(matches(r, s.query))})"
        if s.only is not None:
            top += f" · only {s.only.value}"
        if any(not f.done for f in self.feeds):
            top += " · LIVE"
        for f in self.feeds:
            if f.failure:
                top += f" · FAILED: {f.failure}"
        self.query_one("#topbar", Static).update(top)
        present = sorted({t.cls for x in self.replays for t in x.trace.tokens}, key=CLASSES.index)
        self.query_one("#legend", Static).update(legend(present))

    def _poll_feeds(self) -> None:
        grew = False
        for f in self.feeds:
            if f.poll():
                f.replay.refresh()
                grew = True
        if grew:
            self.state.step = 10**9  # follow the run
            self.refresh_view()

    # ----------------------------------------------------------- actions
    def action_step(self, delta: int) -> None:
        self.state.step = self.clamp(self.clamp(self.state.step) + delta)
        self.refresh_view()

    def action_step_to(self, step: int) -> None:
        self.state.step = self.clamp(step)
        self.refresh_view()

    def action_group(self, delta: int) -> None:
        n = max(len(r.groups) for r in self.replays)
        self.state.group = (self.state.group + delta) % n
        self.refresh_view()

    def action_group_to(self, g: int) -> None:
        if g < max(len(r.groups) for r in self.replays):
            self.state.group = g
            self.refresh_view()

    def action_cursor(self, delta: int) -> None:
        self.state.cursor += delta
        self.refresh_view()

    def action_row(self, delta: int) -> None:
        pane = self.query_one(TracePane)
        from .widgets import TokenView

        layout = getattr(pane.query_one(TokenView), "layout_info", None)
        if layout is None:
            return
        cur = self.state.cursor
        row = layout.line_of[cur] + delta
        same = [p for p, r_ in enumerate(layout.line_of) if r_ == row]
        if same:
            self.state.cursor = same[0]
            self.refresh_view()

    def action_filter(self, delta: int) -> None:
        present = sorted({t.cls for r in self.replays for t in r.trace.tokens}, key=CLASSES.index)
        options = [None, *present]
        i = options.index(self.state.only) if self.state.only in options else 0
        self.state.only = options[(i + delta) % len(options)]
        if self.state.only is not None:
            hit = [t.pos for t in self.primary.trace.tokens if t.cls == self.state.only]
            after = [p for p in hit if p >= self.state.cursor]
            self.state.cursor = (after or hit)[0]
        self.refresh_view()

    def action_toggle_rows(self) -> None:
        self.state.layer_rows = not self.state.layer_rows
        self.set_class(self.state.layer_rows, "layer-rows")
        self.refresh_view()

    def action_toggle_zoom(self) -> None:
        self.state.zoom = not self.state.zoom
        self.refresh_view()

    def action_toggle_side(self) -> None:
        side = self.query_one(SidePanel)
        side.display = not side.display
        self.call_after_refresh(self.refresh_view)

    def action_search(self) -> None:
        box = self.query_one("#search", Input)
        box.display = True
        box.value = self.state.query
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.state.query = event.value.strip()
        event.input.display = False
        self.set_focus(None)
        hits = matches(self.primary, self.state.query)
        if hits:
            after = [p for p in hits if p >= self.state.cursor]
            self.state.cursor = (after or hits)[0]
        self.refresh_view()

    def on_key(self, event) -> None:
        box = self.query_one("#search", Input)
        if event.key == "escape" and box.display:
            box.display = False
            self.set_focus(None)
            event.stop()

    def action_next_match(self, delta: int) -> None:
        hits = matches(self.primary, self.state.query)
        if not hits:
            return
        cur = self.state.cursor
        if delta > 0:
            nxt = [p for p in hits if p > cur]
            self.state.cursor = (nxt or hits)[0]
        else:
            prv = [p for p in hits if p < cur]
            self.state.cursor = (prv or hits)[-1]
        self.refresh_view()

    def on_cursor_to(self, msg: CursorTo) -> None:
        self.state.cursor = msg.pos
        if msg.group is not None:
            self.state.group = msg.group
        self.refresh_view()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def screenshot(app: TraceApp, path: Path) -> None:
    """Write the app's current screen as SVG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    app.save_screenshot(filename=path.name, path=str(path.parent))
