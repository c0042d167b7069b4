"""Trace loader and replay (pask_local.tui.trace / .replay).

Bad-input tests damage a real engine trace (cut it, corrupt a line, reorder lines) and check the
one-line message names the line and the problem. Replay tests check the positions replayed from the
evict lines against what the engine reported from the native cache: every ``step.kept`` and
``final.retained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pask_local.tui.replay import Replay
from pask_local.tui.trace import TraceError, load_trace
from tui_helpers import real_trace, run_stats, run_stderr

from pask_local.errors import PaskError

slow = pytest.mark.slow  # needs a real engine run (shared per session)
METHODS = ["pask", "snapkv", "streaming"]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _write(tmp_path: Path, lines: list[str], name: str = "bad.jsonl", newline: bool = True) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + ("\n" if newline else ""))
    return p


def _first(lines: list[str], kind: str, start: int = 0, **match) -> int:
    for i in range(start, len(lines)):
        o = json.loads(lines[i])
        if o["type"] == kind and all(o.get(k) == v for k, v in match.items()):
            return i
    raise AssertionError(f"no {kind} line {match} in the trace")


# ------------------------------------------------------------ bad input
def test_missing_file_is_a_pask_error(tmp_path):
    with pytest.raises(PaskError, match="trace file not found: .*nope.jsonl"):
        load_trace(tmp_path / "nope.jsonl")


def test_directory_and_empty_and_binary(tmp_path):
    with pytest.raises(TraceError, match="not a trace file"):
        load_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="empty trace file"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(tmp_path / "bin.jsonl")


@slow
def test_truncated_mid_line_names_the_line(tmp_path):
    lines = _lines(real_trace("pask"))
    k = _first(lines, "step")
    cut = lines[:k] + [lines[k][: len(lines[k]) // 2]]
    p = _write(tmp_path, cut, newline=False)
    with pytest.raises(TraceError, match=rf"line {k + 1}: the line is cut off \(file truncated\?\)"):
        load_trace(p)


@slow
def test_truncated_at_a_line_boundary_has_no_final(tmp_path):
    lines = _lines(real_trace("pask"))
    p = _write(tmp_path, lines[:-1])
    with pytest.raises(TraceError, match=rf"truncated after line {len(lines) - 1}: no final line"):
        load_trace(p)
    partial = load_trace(p, require_final=False)   # what a live view sees mid-run
    assert partial.final is None and len(partial.steps) == len(load_trace(real_trace("pask")).steps)


@slow
def test_corrupt_line(tmp_path):
    lines = _lines(real_trace("pask"))
    k = _first(lines, "evict")
    lines[k] = lines[k].replace('"positions": [', '"positions": [[', 1)
    with pytest.raises(TraceError, match=rf"line {k + 1}: not valid JSON"):
        load_trace(_write(tmp_path, lines))


@slow
def test_structural_errors_name_line_and_problem(tmp_path):
    lines = _lines(real_trace("pask"))
    cases = []
    # no header first
    cases.append((lines[1:], r"line 1: the first line must be the header, got a 'token' line"))
    # tokens out of order
    swapped = list(lines)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    cases.append((swapped, r"line 2: token at position 1, expected position 0"))
    # an unknown class
    k = _first(lines, "token")
    o = json.loads(lines[k])
    o["cls"] = "adjective"
    bad = list(lines)
    bad[k] = json.dumps(o)
    cases.append((bad, rf"line {k + 1}: unknown structural class 'adjective'"))
    # eviction of a position that does not exist yet
    k = _first(lines, "evict")
    o = json.loads(lines[k])
    n_pos = sum(1 for ln in lines if json.loads(ln)["type"] == "token")
    o["positions"] = [n_pos + 5]
    bad = list(lines)
    bad[k] = json.dumps(o)
    cases.append((bad, rf"line {k + 1}: evicts position {n_pos + 5}, which does not exist"))
    # a layer reported in the wrong group
    o = json.loads(lines[k])
    o["group"] = o["group"] + 1
    bad = list(lines)
    bad[k] = json.dumps(o)
    cases.append((bad, rf"line {k + 1}: layer {o['layer']} is in group {o['group'] - 1}"))
    # a line after final
    cases.append((lines + [lines[-2]], rf"line {len(lines) + 1}: a '\w+' line after the final line"))
    for i, (ls, msg) in enumerate(cases):
        with pytest.raises(TraceError, match=msg):
            load_trace(_write(tmp_path, ls, name=f"case{i}.jsonl"))


def test_tui_command_reports_bad_input(tmp_path):
    from pask_local.tui.cli import tui_command

    with pytest.raises(TraceError, match="trace file not found"):
        tui_command(tmp_path / "missing.jsonl")
    (tmp_path / "x.jsonl").write_text("{}\n")
    with pytest.raises(TraceError, match="line 1: expected a JSON object with a \"type\""):
        tui_command(tmp_path / "x.jsonl")
    with pytest.raises(PaskError, match="--request/--schema are for --live"):
        tui_command(tmp_path / "x.jsonl", request="hi")
    with pytest.raises(PaskError, match="--live needs --request TEXT and --schema FILE"):
        tui_command(tmp_path / "live.jsonl", live=True)


# --------------------------------------------------------------- replay
@pytest.mark.parametrize("method", METHODS)
@slow
def test_replay_matches_native_counts(method):
    """Replayed per-group entries equal what the engine read from the native cache at every step."""
    t = load_trace(real_trace(method))
    r = Replay(t)
    assert t.steps, "the run generated no steps"
    assert t.evicts, f"{method} evicted nothing at budget 0.33"
    for s in t.steps:
        assert r.kept_per_group(s.step) == s.kept, f"{method} step {s.step}"
    assert t.final is not None
    assert r.retained(r.last_step) == t.final.retained


@pytest.mark.parametrize("method", METHODS)
@slow
def test_step_changes_account_for_kept_deltas(method):
    """kept[g](s) = kept[g](s-1) + one new entry per layer - the entries evicted at step s."""
    t = load_trace(real_trace(method))
    r = Replay(t)
    prev = r.kept_per_group(-1)
    for s in t.steps:
        for g, layers in enumerate(r.groups):
            ch = r.changes(s.step, g)
            assert ch.added == s.pos
            dropped = sum(e.layers for e in ch.evicted)
            assert s.kept[g] == prev[g] + len(layers) - dropped, f"{method} step {s.step} group {g}"
            rules = {e.rule for e in t.evicts if e.step == s.step and e.group == g}
            assert set(ch.rule_counts()) == rules
        prev = s.kept


@pytest.mark.parametrize("method", METHODS)
@slow
def test_class_stats_add_up(method):
    t = load_trace(real_trace(method))
    r = Replay(t)
    assert t.final is not None
    last = r.last_step
    for g in range(len(r.groups)):
        stats = r.class_stats(last, g)
        assert sum(st.total for st in stats) == r.n_seq(last)
        assert sum(st.kept for st in stats) == len(t.final.retained[g])
        by_cls = {st.cls: st.kept for st in stats}
        for c in by_cls:
            want = sum(1 for p in t.final.retained[g] if t.tokens[p].cls == c)
            assert by_cls[c] == want, (method, g, c)


@pytest.mark.parametrize("method", METHODS)
@slow
def test_budget_used_matches_engine_stats(method):
    """KV used vs full, replayed, equals the engine's own --stats-json (native counts) after prefill
    and at the end."""
    path = real_trace(method)
    t = load_trace(path)
    r = Replay(t)
    stats = run_stats(path)
    assert r.budget_used(-1) == pytest.approx(stats["budget_used_after_prefill"], abs=1e-9)
    assert r.budget_used(r.last_step) == pytest.approx(stats["budget_used_final"], abs=1e-9)
    assert r.kept_per_group(r.last_step) == stats["held_per_group"]


# ----------------------------------------------------------- full KV has no budget
@slow
def test_full_kv_trace_and_stats_have_no_budget():
    """`run --method full`: header budget null, --stats-json budget null, the --stats table titled
    "full KV (no budget)"; a budgeted run keeps its budget in all three."""
    full, pask = real_trace("full"), real_trace("pask")
    assert json.loads(_lines(full)[0])["budget"] is None
    assert load_trace(full).header.budget is None
    assert run_stats(full)["budget"] is None
    assert "full KV (no budget)" in run_stderr(full) and "@ budget" not in run_stderr(full)
    assert load_trace(pask).header.budget == pytest.approx(0.33)
    assert run_stats(pask)["budget"] == pytest.approx(0.33)
    assert "pask @ budget 0.33" in run_stderr(pask) and "no budget" not in run_stderr(pask)


@slow
def test_budget_null_backward_compatible(tmp_path):
    """Older Full traces carry the CLI's budget: still read as no budget. null is refused for a
    method that has a budget, with a one-line error naming the line."""
    lines = _lines(real_trace("full"))
    head = json.loads(lines[0])
    head["budget"] = 0.33
    old = _write(tmp_path, [json.dumps(head), *lines[1:]], name="old-full.jsonl")
    assert load_trace(old).header.budget is None
    lines = _lines(real_trace("pask"))
    head = json.loads(lines[0])
    head["budget"] = None
    bad = _write(tmp_path, [json.dumps(head), *lines[1:]], name="null-pask.jsonl")
    with pytest.raises(TraceError, match=r"line 1: \"budget\" is null, but only full KV runs have no budget"):
        load_trace(bad)
