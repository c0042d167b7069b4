"""Hostile inputs through the real CLI: each row builds one bad input, runs ``pask-local`` on it and
records the exit code, the stderr line count and the error line, plus whether a side effect (a
marker file a template payload tries to create) appeared. Each row carries what a safe CLI answers:
exit status 1, one stderr line ``error: ...`` containing the row's expected fragment, no traceback,
no side effect; a row that answers otherwise fails (exit status 1 of the script). Prints a markdown
table; ``--json FILE`` also writes the rows. Uses the project's synthetic GGUF writer and the named
model gemma3-270m (installed by ``scripts/setup``); every row runs with ``PASK_THREADS=1``.
``tests/test_hostile_inputs.py`` runs it in the suite.

    .venv/bin/python scripts/hostile_inputs.py [--json results/hostile_inputs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.policy.handwritten import handwritten_policy

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "examples" / "get_weather.json"
EXE = str(Path(sys.executable).with_name("pask-local"))


def _payload_gguf(tmp: Path, marker: Path, payload: str) -> Path:
    path = tmp / f"evil{len(list(tmp.glob('evil*.gguf')))}.gguf"
    write_synthetic_gguf(path, "qwen3", n_layer=2, n_vocab=320,
                         chat_template=payload + "{% for m in messages %}{{ m.content }}{% endfor %}")
    return path


def _edited_gguf(tmp: Path, name: str, edit: Callable[[bytes], bytes]) -> Path:
    good = tmp / "good.gguf"
    if not good.exists():
        write_synthetic_gguf(good, "qwen3", n_layer=2, n_vocab=320)
    path = tmp / name
    path.write_bytes(edit(good.read_bytes()))
    return path


def _json_file(tmp: Path, name: str, data: object) -> Path:
    path = tmp / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def _deep_schema(depth: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    return {"name": "deep", "description": "d", "parameters": node}


UNSAFE = "the model's chat template tried an unsafe operation, refused"


def cases(tmp: Path, marker: Path) -> list[tuple[str, list[str], str]]:
    """(label, pask-local arguments, a fragment the one error line must contain) for every hostile input."""
    run = ["run", "--method", "full", "--max-tokens", "16"]
    model = ["--model", "gemma3-270m"]  # the rows that bring no GGUF of their own
    named = [*run, *model]
    pol = handwritten_policy(18).to_json()
    pol_nan = json.loads(json.dumps(pol))
    pol_nan["floors"][0]["description"] = float("nan")
    pol_gap = json.loads(json.dumps(pol))
    pol_gap["groups"][0].pop(0)
    weather = json.loads(SCHEMA.read_text())
    return [
        ("template: cycler.__init__.__globals__.os.system",
         [*run, "--gguf", str(_payload_gguf(tmp, marker, "{{ cycler.__init__.__globals__.os.system('touch "
                                                          + str(marker) + "') }}")), "--schema", str(SCHEMA), "hi"],
         UNSAFE),
        ("template: ''.__class__.__mro__[1].__subclasses__()",
         [*run, "--gguf", str(_payload_gguf(tmp, marker, "{{ ''.__class__.__mro__[1].__subclasses__() }}")),
          "--schema", str(SCHEMA), "hi"], UNSAFE),
        ("template: joiner globals os.popen",
         [*run, "--gguf", str(_payload_gguf(tmp, marker, "{{ joiner.__init__.__globals__.os.popen('touch "
                                                          + str(marker) + "').read() }}")), "--schema", str(SCHEMA), "hi"],
         UNSAFE),
        ("template that raises", [*run, "--gguf", str(_payload_gguf(tmp, marker, "{{ raise_exception('this template "
                                                                     "takes no tools') }}")), "--schema", str(SCHEMA), "hi"],
         "chat template error: this template takes no tools"),
        ("GGUF truncated to half", [*run, "--gguf", str(_edited_gguf(tmp, "half.gguf", lambda b: b[: len(b) // 2])),
                                    "--schema", str(SCHEMA), "hi"], "half.gguf: truncated"),
        ("GGUF wrong magic", [*run, "--gguf", str(_edited_gguf(tmp, "magic.gguf", lambda b: b"GGUX" + b[4:])),
                              "--schema", str(SCHEMA), "hi"], "magic.gguf is not a GGUF file (bad magic b'GGUX')"),
        ("GGUF of zero bytes", [*run, "--gguf", str(_edited_gguf(tmp, "empty.gguf", lambda b: b"")),
                                "--schema", str(SCHEMA), "hi"], "empty.gguf is not a GGUF file (bad magic b'')"),
        ("policy: floor NaN", ["run", *model, "--method", "pask", "--policy",
                               str(_json_file(tmp, "nan.json", json.dumps(pol_nan))), "--schema", str(SCHEMA), "hi"],
         "floors[0][description] = nan must be a number in [0, 1.0]"),
        ("policy: groups miss layer 0", ["run", *model, "--method", "pask", "--policy",
                                         str(_json_file(tmp, "gap.json", pol_gap)), "--schema", str(SCHEMA), "hi"],
         "groups must partition layers"),
        ("budget 1.5", ["run", *model, "--budget", "1.5", "--schema", str(SCHEMA), "hi"],
         "--budget must be in (0, 1], got 1.5"),
        ("schema 50 levels deep", [*named, "--schema", str(_json_file(tmp, "deep.json", [_deep_schema(50)])), "hi"],
         "is nested more than 16 levels deep"),
        ("1,000 tools", [*named, "--schema", str(_json_file(tmp, "many.json", [
            {"type": "function", "function": {**weather["function"], "name": f"tool_{i}"}} for i in range(1000)])),
                         "hi"], "1000 tools given, at most 256 are supported"),
        ("schema is not JSON", [*named, "--schema", str(_json_file(tmp, "bad.json", "{not json")), "hi"],
         "tool definitions are not valid JSON"),
        ("messages: tool result for no call", [*named, "--schema", str(SCHEMA), "--messages", str(_json_file(
            tmp, "msgs.json", [{"role": "user", "content": "hi"},
                               {"role": "tool", "tool_call_id": "call_nope", "content": "20C"}]))],
         "references call id 'call_nope', which no earlier assistant message made"),
        ("tool_choice: unknown function", [*named, "--schema", str(SCHEMA), "--tool-choice", "no_such_fn", "hi"],
         "tool_choice names function 'no_such_fn', which is not among the tools"),
        ("request longer than the context", [*named, "--schema", str(SCHEMA), "--messages", str(_json_file(
            tmp, "long.json", [{"role": "user", "content": "word " * 40000}]))], "exceed the model's trained context"),
        ("trace file is binary", ["tui", str(_json_file(tmp, "trace.jsonl", "\x00\x01\x02garbage"))],
         "trace.jsonl, line 1"),
    ]


def safe(row: dict) -> bool:
    """What a safe CLI answers to a hostile input: exit status 1 (a PaskError), one stderr line, the
    expected ``error: ...`` text, no traceback, no side effect."""
    return (row["exit"] == 1 and row["stderr_lines"] == 1 and row["error"].startswith("error: ")
            and row["expect"] in row["error"] and not row["traceback"] and not row["side_effect"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        marker = tmp / "pwned"
        env = {**os.environ, "PASK_THREADS": "1"}
        for label, argv, expect in cases(tmp, marker):
            t0 = time.perf_counter()
            proc = subprocess.run([EXE, *argv], capture_output=True, text=True, timeout=300, env=env,
                                  stdin=subprocess.DEVNULL)
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            rows.append({"input": label, "expect": expect, "exit": proc.returncode, "stderr_lines": len(lines),
                         "traceback": "Traceback" in proc.stderr, "side_effect": marker.exists(),
                         "seconds": round(time.perf_counter() - t0, 2), "error": lines[-1] if lines else ""})
            marker.unlink(missing_ok=True)
    print("| input | safe | exit | stderr lines | traceback | side effect | s | message |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        msg = r["error"].replace("|", "\\|")[:160]
        print(f"| {r['input']} | {'yes' if safe(r) else 'NO'} | {r['exit']} | {r['stderr_lines']} | {r['traceback']} "
              f"| {r['side_effect']} | {r['seconds']} | {msg} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not safe(r)]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
