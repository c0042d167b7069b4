"""The Textual app driven by Pilot on real engine traces: what the widgets show after each key.

Expected values come from the trace file itself (its ``final.retained``, ``step`` and ``token``
lines), not from the replay code the widgets use.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
from pathlib import Path

import pytest
from pask_local.tui.app import HelpScreen, TraceApp
from pask_local.tui.render import FILTERED_OUT
from pask_local.tui.style import colour
from pask_local.tui.trace import load_trace
from pask_local.tui.widgets import Heatmap, SidePanel, StepInfo, TokenView, TracePane
from rich.console import Console
from textual.widget import Widget
from textual.widgets import Static
from tui_helpers import real_trace

from pask_local.classes import StructuralClass

pytestmark = pytest.mark.slow  # needs real engine traces (shared per session)


def sync(fn):
    """Run an async Pilot test with asyncio.run (no pytest async plugin needed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


def _raw(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def _plain(widget: Static) -> str:
    r = widget.render()
    return str(getattr(r, "plain", r))


def _on_screen(app: TraceApp, widget: Widget) -> str:
    """The characters the terminal shows inside ``widget``'s region."""
    w, h = app.size
    con = Console(width=w, height=h, file=io.StringIO(), record=True, force_terminal=True, color_system=None)
    con.print(app.screen._compositor.render_update(full=True))
    rows = con.export_text().splitlines()
    reg = widget.region
    return "\n".join(row[reg.x:reg.right] for row in rows[reg.y:reg.bottom])


def _styles(app: TraceApp, pane: int = 0) -> dict[int, str]:
    tv = app.query_one(f"#pane{pane}", TracePane).query_one(TokenView)
    return {p: st for p, (_, _, st) in tv.layout_info.spans.items()}


def _title(app: TraceApp, pane: int = 0) -> str:
    return _plain(app.query_one(f"#pane{pane}", TracePane).query_one(".pane-title", Static))


def _step_text(app: TraceApp, pane: int = 0) -> str:
    return _plain(app.query_one(f"#pane{pane}", TracePane).query_one(StepInfo))


@sync
async def test_main_view_step_group_filter():
    path = real_trace("pask")
    raw = _raw(path)
    final = raw[-1]
    steps = [o for o in raw if o["type"] == "step"]
    tokens = [o for o in raw if o["type"] == "token"]
    n_prompt = final["n_prompt"]
    last = len(steps) - 1
    n_seq_last = n_prompt + last + 1
    app = TraceApp.from_traces([load_trace(path)])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        # opens on the last step, group 0
        assert _step_text(app).startswith(f"step {last}/{last}")
        assert f"g0 {len(final['retained']['0'])}/{n_seq_last} pos" in _title(app)
        styles = _styles(app)
        plain = {p for p, st in styles.items() if "dim" not in st}
        assert plain == {p for p in final["retained"]["0"]}, "unstruck tokens = the engine's retained set"
        struck = {p for p, st in styles.items() if "strike" in st}
        assert struck and not struck & set(final["retained"]["0"])

        # step back: the step line shows the previous step's token
        await pilot.press("left")
        text = _step_text(app)
        assert text.startswith(f"step {last - 1}/{last}")
        assert f"+{steps[last - 1]['pos']} " in text
        # to prefill, then one step forward
        await pilot.press("home")
        assert _step_text(app).startswith(f"prefill/{last}")
        assert max(_styles(app)) == n_prompt - 1, "no generated token is shown at prefill"
        await pilot.press("right")
        assert _step_text(app).startswith(f"step 0/{last}")
        added = _styles(app)[n_prompt]
        assert "bold underline" in added
        assert colour(StructuralClass(tokens[n_prompt]["cls"])) in added

        # change group: title counts come from retained[1] at the last step
        await pilot.press("end", "g")
        assert f"g1 {len(final['retained']['1'])}/{n_seq_last} pos" in _title(app)
        assert "g1 (L" in _on_screen(app, app.query_one(SidePanel))
        plain = {p for p, st in _styles(app).items() if "dim" not in st}
        assert plain == set(final["retained"]["1"])

        # filter by class: the first class present (sink) keeps its colour, the rest are greyed
        await pilot.press("f")
        first_cls = StructuralClass(tokens[0]["cls"])
        assert f"only {first_cls.value}" in _plain(app.query_one("#topbar", Static))
        styles = _styles(app)
        for p, st in styles.items():
            c = StructuralClass(tokens[p]["cls"])
            assert (colour(c) in st) == (c == first_cls), (p, st)
            assert (FILTERED_OUT in st) == (c != first_cls)
        await pilot.press("f", "F", "F")   # next class, back, then back to "all"
        assert "only" not in _plain(app.query_one("#topbar", Static))


@sync
async def test_search_help_and_heatmap_click():
    path = real_trace("pask")
    tokens = [o for o in _raw(path) if o["type"] == "token"]
    want = [o["pos"] for o in tokens if "paris" in o["text"].lower()]
    assert want, "the request mentions Paris"
    app = TraceApp.from_traces([load_trace(path)])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("slash", *"paris", "enter")
        assert app.state.cursor == want[0]
        cur = _step_text(app).splitlines()[-1]
        assert cur.startswith(f"@{want[0]} ")
        assert "reverse" in _styles(app)[want[0]]
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        # a click on a heatmap column moves the cursor to that column's first position
        hm = app.query_one(Heatmap)
        info = hm.layout_info
        x = info.label_w + 5
        await pilot.click(Heatmap, offset=(x, 2))
        assert app.state.cursor == info.pos_at(x)
        assert app.state.group == info.rows[1]
        # a click on a token moves the cursor to it
        await pilot.press("home")
        tv = app.query_one(TokenView)
        tv.scroll_home(animate=False)
        await pilot.pause()
        p = 3
        row, col, _ = tv.layout_info.cells[p]
        await pilot.click("#token-text", offset=(col, row))
        assert app.state.cursor == p
        assert _step_text(app).splitlines()[-1].startswith(f"@{p} ")


SHORT = 10  # --max-tokens of the shorter run: below any complete weather call, so it stops at 10 steps


def _steps(path: Path) -> list[dict]:
    return [o for o in _raw(path) if o["type"] == "step"]


@pytest.mark.parametrize("short_first", [True, False], ids=["short-left", "short-right"])
@sync
async def test_compare_mode_shows_both_traces(short_first):
    """Traces of different lengths (the same run cut at --max-tokens 10): End shows each pane's own
    final state read from its own trace file; the slider runs to the longer trace's last step and
    the shorter pane holds its last step, marked (ended)."""
    long_p = real_trace("pask")
    short_p = real_trace("pask", max_tokens=SHORT, valid=False)
    paths = [short_p, long_p] if short_first else [long_p, short_p]
    fin = [_raw(p)[-1] for p in paths]
    last = [len(_steps(p)) - 1 for p in paths]
    s, lg = (0, 1) if short_first else (1, 0)
    assert last[s] == SHORT - 1 < last[lg], "the two traces must differ in length"
    app = TraceApp.from_traces([load_trace(p) for p in paths])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert not app.query_one(SidePanel).display

        def at_end(group: int) -> None:
            for i in range(2):
                n_seq = fin[i]["n_prompt"] + last[i] + 1
                assert f"g{group} {len(fin[i]['retained'][str(group)])}/{n_seq} pos" in _title(app, i)
                plain = {p for p, st in _styles(app, i).items() if "dim" not in st}
                assert plain == set(fin[i]["retained"][str(group)]), f"pane {i} group {group}"
            assert _step_text(app, lg).startswith(f"step {last[lg]}/{last[lg]} ")
            assert _step_text(app, s).startswith(f"step {last[s]}/{last[s]} (ended)")

        at_end(0)
        # one step back: the longer pane moves, the shorter one stays on its last step
        await pilot.press("left")
        assert _step_text(app, lg).startswith(f"step {last[lg] - 1}/{last[lg]} ")
        assert f"+{_steps(paths[lg])[last[lg] - 1]['pos']} " in _step_text(app, lg)
        assert _step_text(app, s).startswith(f"step {last[s]}/{last[s]} (ended)")
        # from prefill, step both forward to the shorter trace's last step, then one past it
        await pilot.press("home")
        for i in range(2):
            assert _step_text(app, i).startswith(f"prefill/{last[i]}")
        await pilot.press(*["right"] * (last[s] + 1))
        for i in range(2):
            text = _step_text(app, i)
            assert text.startswith(f"step {last[s]}/{last[i]} ") and "(ended)" not in text
            assert f"+{_steps(paths[i])[last[s]]['pos']} " in text
        await pilot.press("right")
        assert _step_text(app, lg).startswith(f"step {last[s] + 1}/{last[lg]} ")
        assert _step_text(app, s).startswith(f"step {last[s]}/{last[s]} (ended)")
        # End, then group 2 (key "2" = group 1): each pane at its own final state again
        await pilot.press("end")
        at_end(0)
        await pilot.press("2")
        at_end(1)


@sync
async def test_full_kv_is_shown_without_a_budget():
    """A Full run's header has budget null; the viewer calls it "full KV (no budget)" and never shows a
    budget next to it, while the PASK pane beside it keeps its budget."""
    full_p, pask_p = real_trace("full"), real_trace("pask")
    assert _raw(full_p)[0]["budget"] is None
    assert _raw(pask_p)[0]["budget"] == 0.33
    app = TraceApp.from_traces([load_trace(full_p)])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        top = _plain(app.query_one("#topbar", Static))
        side = _on_screen(app, app.query_one(SidePanel))
        title = _title(app)
        assert "full KV (no budget)" in top and "budget 0.33" not in top
        assert "full KV (no budget)" in side and "(no budget)" in side and "0.33" not in side
        assert title.strip().startswith("full") and title.endswith("· no budget") and "/0.33" not in title
    app = TraceApp.from_traces([load_trace(pask_p), load_trace(full_p)])
    async with app.run_test(size=(160, 30)) as pilot:
        await pilot.pause()
        top = _plain(app.query_one("#topbar", Static))
        assert "pask · budget 0.33 vs full KV (no budget)" in top
        assert "/0.33" in _title(app, 0)
        assert _title(app, 1).endswith("· no budget") and "/0.33" not in _title(app, 1)


@pytest.mark.parametrize("size", [(80, 24), (160, 50)])
@sync
async def test_layout_fits(size):
    app = TraceApp.from_traces([load_trace(real_trace("pask"))])
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        tv = app.query_one(TokenView)
        assert tv.region.height >= 5 and tv.region.width >= 30
        hm = app.query_one(Heatmap)
        assert hm.region.height == len(app.primary.groups) + 1   # ruler + one row per group
        assert app.query_one(SidePanel).region.width > 0
        for w in (tv, hm, app.query_one(StepInfo), app.query_one("#legend")):
            assert w.region.bottom <= size[1] and w.region.right <= size[0]


@sync
async def test_live_feed_follows_a_real_run(tmp_path):
    """--live: the engine runs in a thread, the app tails its trace; at the end the view equals the
    finished trace's (retained set of group 0, last step)."""
    from pask_local.tui.cli import engine_job
    from pask_local.tui.live import start_run
    from tui_helpers import REQUEST, WEATHER

    out = tmp_path / "live.jsonl"
    feed = start_run(engine_job(REQUEST, WEATHER, "pask", 0.33, None, 48), out)
    app = TraceApp([feed.replay], feeds=[feed], on_exit=feed.close)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(1200):
            if feed.done:
                break
            await pilot.pause(0.1)
        await pilot.pause(0.5)  # one more poll of the feed after the final line
        assert feed.failure is None and feed.done
        final = _raw(out)[-1]
        assert final["type"] == "final"
        last = sum(1 for o in _raw(out) if o["type"] == "step") - 1
        assert _step_text(app).startswith(f"step {last}/{last}")
        assert "LIVE" not in _plain(app.query_one("#topbar", Static))
        plain = {p for p, st in _styles(app).items() if "dim" not in st}
        assert plain == set(final["retained"]["0"])
    feed.worker.join(timeout=60)
