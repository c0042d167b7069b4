#!/usr/bin/env python3
"""SVG screenshots of the trace viewer (docs/tui-main.svg, docs/tui-compare.svg) from real traces.

By default it runs the engine on the embedded model (`pask-local run --trace`, PASK and SnapKV on
examples/get_weather.json); pass --pask/--baseline to use traces you already have.

    .venv/bin/python scripts/tui_screenshots.py [--pask T.jsonl] [--baseline T2.jsonl] [--out docs]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from pask_local.tui.app import TraceApp
from pask_local.tui.trace import load_trace

REPO = Path(__file__).resolve().parent.parent
REQUEST = "What is the weather in Paris in celsius?"


def engine_trace(method: str, out: Path) -> Path:
    exe = Path(sys.executable).parent / "pask-local"
    cmd = [str(exe), "run", "--method", method, "--budget", "0.33", "--schema",
           str(REPO / "examples" / "get_weather.json"), "--trace", str(out), REQUEST]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-800:]}")
    print(f"{method}: {proc.stdout.strip()}")
    return out


async def shoot(paths: list[Path], size: tuple[int, int], keys: list[str], dest: Path) -> None:
    app = TraceApp.from_traces([load_trace(p) for p in paths])
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        for k in keys:
            await pilot.press(k)
        await pilot.pause()
        dest.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=dest.name, path=str(dest.parent))
    print(f"wrote {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pask", type=Path, help="a PASK trace (default: run the engine)")
    ap.add_argument("--baseline", type=Path, help="a baseline trace for compare mode (default: run SnapKV)")
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pask-shots-") as tmp:
        pask = args.pask or engine_trace("pask", Path(tmp) / "pask.jsonl")
        base = args.baseline or engine_trace("snapkv", Path(tmp) / "snapkv.jsonl")
        # main view: group 1, cursor on the request's city, a few steps before the end
        asyncio.run(shoot([pask], (100, 32), ["2", "slash", *"Paris", "enter", "left", "left"],
                          args.out / "tui-main.svg"))
        asyncio.run(shoot([pask], (80, 24), ["2"], args.out / "tui-main-80x24.svg"))
        asyncio.run(shoot([pask, base], (120, 32), ["2", "slash", *"Paris", "enter"], args.out / "tui-compare.svg"))


if __name__ == "__main__":
    main()
