"""The Textual widgets: one trace pane (tokens, heatmap, step line) and the side panel.

They hold no state of their own beyond their last rendering: the app owns the ``ViewState`` and
calls ``show()`` on every change.
"""

from __future__ import annotations

from textual import events
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Static

from .render import (
    HeatLayout,
    PaneView,
    TokenLayout,
    ViewState,
    heatmap,
    pane_title,
    side_panel,
    step_info,
    token_stream,
)
from .replay import Replay


class CursorTo(Message):
    """The user clicked a position (heatmap column); the app moves the cursor there."""

    def __init__(self, pos: int, group: int | None) -> None:
        super().__init__()
        self.pos = pos
        self.group = group


class TokenText(Static):
    """The token stream's text; a click on a token moves the cursor to it."""

    def on_click(self, event: events.Click) -> None:
        view = self.parent
        layout = getattr(view, "layout_info", None)
        if layout is not None:
            pos = layout.pos_at(event.x, event.y)
            if pos is not None:
                self.post_message(CursorTo(pos, None))


class TokenView(VerticalScroll):
    """The token stream, wrapped by the view itself so the cursor's row is known and kept visible."""

    can_focus = False
    layout_info: TokenLayout | None = None

    def compose(self):
        yield TokenText(id="token-text")

    def show(self, view: PaneView, state: ViewState) -> TokenLayout:
        width = self.scrollable_content_region.width or self.size.width or 40
        layout = token_stream(view, state, width)
        self.query_one("#token-text", Static).update(layout.text)
        self.layout_info = layout
        row = layout.line_of[view.cursor] if 0 <= view.cursor < len(layout.line_of) else -1
        if row >= 0:
            h = max(1, self.scrollable_content_region.height)
            if not self.scroll_y <= row < self.scroll_y + h:
                self.scroll_to(y=max(0, row - h // 2), animate=False)
        return layout


class Heatmap(Static):
    """Groups (or layers) x positions; clicking a column moves the cursor there."""

    layout_info: HeatLayout | None = None

    def show(self, view: PaneView, state: ViewState) -> None:
        # leave the token view and the step lines their rows: 19 = bars, borders, titles, step lines
        max_rows = max(len(view.replay.groups), self.app.size.height - 19)
        self.layout_info = heatmap(view, state, self.content_region.width or 40, max_rows)
        self.update(self.layout_info.text)

    def on_click(self, event: events.Click) -> None:
        info = self.layout_info
        if info is None:
            return
        pos = info.pos_at(event.x)
        row = event.y - 1
        group = info.rows[row] if 0 <= row < len(info.rows) else None
        if pos is not None:
            self.post_message(CursorTo(pos, group))


class StepInfo(Static):
    def show(self, view: PaneView, state: ViewState) -> None:
        self.update(step_info(view, state, self.content_region.width or 40))


class TracePane(Vertical):
    """Everything shown for one trace."""

    def __init__(self, replay: Replay, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replay = replay

    def compose(self):
        yield Static(classes="pane-title")
        yield TokenView(classes="tokens")
        yield Heatmap(classes="heatmap")
        yield StepInfo(classes="stepinfo")

    def show(self, state: ViewState) -> PaneView:
        view = PaneView.resolve(self.replay, state)
        self.query_one(".pane-title", Static).update(pane_title(view, state))
        self.query_one(TokenView).show(view, state)
        self.query_one(Heatmap).show(view, state)
        self.query_one(StepInfo).show(view, state)
        return view


class SidePanel(VerticalScroll):
    can_focus = False

    def compose(self):
        yield Static(id="side-text")

    def show(self, view: PaneView, state: ViewState) -> None:
        self.query_one("#side-text", Static).update(side_panel(view, state))
