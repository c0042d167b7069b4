"""Hostile policy and trace files: wrong types, NaN/Infinity, negative or out-of-range numbers,
groups that do not cover the layers, absurd sizes, deep nesting, binary bytes. Each must end in one
line naming the field (``PolicyError`` / ``TraceError``; ``error: ...`` from the CLI), never a
traceback, a hang or a huge allocation."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from pask_local.tui.trace import TraceError, load_trace
from tui_helpers import real_trace

from pask_local.policy.handwritten import handwritten_policy
from pask_local.policy.schema import Policy, PolicyError


def _set(path: tuple, value) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def _del(key: str) -> Callable[[dict], None]:
    return lambda d: d.pop(key)


POLICY_CASES = [
    ("floor-nan", _set(("floors", 0, "description"), float("nan")), "floors[0][description]"),
    ("floor-inf", _set(("floors", 1, "query"), float("inf")), "floors[1][query]"),
    ("floor-above-1", _set(("floors", 0, "query"), 1.5), "floors[0][query] = 1.5"),
    ("floor-negative", _set(("floors", 2, "tool_name"), -0.1), "floors[2][tool_name] = -0.1"),
    ("floor-bool", _set(("floors", 0, "query"), True), "floors[0][query] = True"),
    ("floor-string", _set(("floors", 0, "query"), "0.5"), "floors[0][query]"),
    ("weight-negative", _set(("weights", 1, "template"), -2), "weights[1][template] = -2"),
    ("weight-nan", _set(("weights", 3, "query"), float("nan")), "weights[3][query]"),
    ("weight-infinite", _set(("weights", 0, "query"), float("inf")), "weights[0][query]"),
    ("floors-not-a-list", _set(("floors",), {"sink": 1}), "floors must be a list"),
    ("floors-one-short", lambda d: d["floors"].pop(), "floors must be a list with one table per group"),
    ("floor-table-list", _set(("floors", 0), [0.5]), "floors[0] must be an object"),
    ("unknown-class", _set(("floors", 0, "bogus\nclass"), 0.1), "unknown structural class 'bogus\\nclass' in floors[0]"),
    ("class-like-markup", _set(("floors", 0, "[/bold]"), 0.1), "unknown structural class '[/bold]' in floors[0]"),
    ("groups-gap", lambda d: d["groups"][0].pop(0), "groups must partition"),
    ("groups-duplicate", lambda d: d["groups"][1].append(0), "groups must partition"),
    ("groups-negative", lambda d: d["groups"][0].insert(0, -1), "groups must partition"),
    ("groups-bool", _set(("groups", 0, 0), False), "groups must be a non-empty list"),
    ("groups-float", _set(("groups", 0, 0), 0.0), "groups must be a non-empty list"),
    ("groups-empty-group", lambda d: d["groups"].append([]), "groups must be a non-empty list"),
    ("groups-not-list", _set(("groups",), "0-17"), "groups must be a non-empty list"),
    ("n-layer-disagrees", _set(("n_layer",), 99), "n_layer 99 disagrees"),
    ("n-layer-string", _set(("n_layer",), "18"), "n_layer '18' disagrees"),
    ("kind-list", _set(("kind",), ["calibrated"]), "kind must be one of"),
    ("order-number", _set(("within_class_order",), 3), "within_class_order must be one of"),
    ("never-evict-number", _set(("never_evict",), 3), "never_evict must be a list"),
    ("never-evict-unknown", _set(("never_evict",), ["sink", "nope"]), "'nope' in never_evict"),
    ("never-evict-unhashable", _set(("never_evict",), [["sink"]]), "in never_evict"),
    ("provenance-list", _set(("provenance",), [1, 2]), "provenance must be an object"),
    ("version-string", _set(("version",), "1"), "unsupported policy version"),
    ("version-bool", _set(("version",), True), "unsupported policy version"),
    ("no-format", _del("format"), "not a pask policy"),
]


@pytest.fixture(scope="module")
def policy_json() -> dict:
    return handwritten_policy(18).to_json()


@pytest.mark.parametrize("case,edit,fragment", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_bad_policy_is_one_line_naming_the_field(policy_json: dict, tmp_path: Path, case, edit, fragment) -> None:
    data = copy.deepcopy(policy_json)
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))  # NaN/Infinity written as Python's json reads them back
    with pytest.raises(PolicyError) as err:
        Policy.load(path)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg, msg


def test_good_policy_loads(policy_json: dict, tmp_path: Path) -> None:
    path = tmp_path / "good.json"
    path.write_text(json.dumps(policy_json))
    assert Policy.load(path).n_layer == 18


@pytest.mark.parametrize("content,fragment", [
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "not UTF-8"),
    (b"[" * 200_000, "nested too deeply"),
    (b"{\"format\": \"pask-policy\",", "invalid JSON"),
])
def test_unreadable_policy_files(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(PolicyError, match=fragment):
        Policy.load(path)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        Policy.load(tmp_path)  # a directory


@pytest.mark.slow
@pytest.mark.parametrize("case", ["floor-nan", "groups-gap", "class-like-markup", "layers-of-another-model"])
def test_cli_bad_policy_one_line(policy_json: dict, tmp_path: Path, case: str) -> None:
    data = copy.deepcopy(policy_json)
    fragment = "policy covers 4 layers but the model has 18"
    if case == "layers-of-another-model":
        data = handwritten_policy(4).to_json()
    else:
        edit, fragment = next((e, f) for c, e, f in POLICY_CASES if c == case)
        edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    proc = run_cli("run", "--policy", str(path), "--schema", str(REPO / "examples" / "get_weather.json"),
                   "--method", "pask", "Weather in Oslo?", timeout=300, env={"PASK_THREADS": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode > 0 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0] and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------- traces
def _header_edit(key: str, value) -> Callable[[list[dict]], None]:
    def edit(lines: list[dict]) -> None:
        lines[0][key] = value
    return edit


def _first_of(kind: str, key: str, value) -> Callable[[list[dict]], None]:
    def edit(lines: list[dict]) -> None:
        next(o for o in lines if o["type"] == kind)[key] = value
    return edit


TRACE_CASES = [
    ("budget-nan", _header_edit("budget", float("nan")), "line 1: \"budget\" must be a number in (0, 1]"),
    ("budget-negative", _header_edit("budget", -0.33), "\"budget\" must be a number in (0, 1]"),
    ("budget-above-1", _header_edit("budget", 3), "\"budget\" must be a number in (0, 1]"),
    ("budget-string", _header_edit("budget", "0.33"), "\"budget\" must be a number"),
    ("n-layer-absurd", _header_edit("n_layer", 10**12), "\"groups\" must cover layers 0..999999999999"),
    ("n-layer-zero", _header_edit("n_layer", 0), "\"n_layer\" must be a positive integer"),
    ("groups-gap", lambda ls: ls[0]["groups"][0].pop(), "\"groups\" must cover layers"),
    ("groups-bool", lambda ls: ls[0]["groups"][0].__setitem__(0, True), "\"groups\" must be a list"),
    ("capacity-negative", lambda ls: ls[0]["capacity"].__setitem__(0, -5), "\"capacity\" must be a list of non-negative"),
    ("window-negative", _header_edit("window", -1), "\"window\" be an integer"),
    ("kept-negative", _first_of("step", "kept", [-1, 0, 0, 0]), "\"kept\" must be a list of non-negative"),
    ("class-newline", _first_of("token", "cls", "sink\nquery"), "unknown structural class 'sink\\nquery'"),
    ("pos-float", _first_of("token", "pos", 0.0), "\"pos\" must be an integer"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,edit,fragment", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_bad_trace_is_one_line_naming_the_field(tmp_path: Path, case, edit, fragment) -> None:
    lines = [json.loads(ln) for ln in real_trace("pask").read_text().splitlines()]
    edit(lines)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg, msg


def test_deeply_nested_trace_line(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 200_000 + "\n")
    with pytest.raises(TraceError, match="line 1: JSON nested too deeply"):
        load_trace(path)
