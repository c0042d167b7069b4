"""The resumable per-case result file: ``cases.jsonl`` (one JSON object per scored case) + ``run.json``.

A record is keyed by (case id, method, budget); a rerun skips keys already present, so an
interrupted run continues where it stopped. ``run.json`` pins what the records were produced with
(model file, generation settings, bfcl-eval version, split); reusing an output directory with
different settings is refused, since mixing them would make the tables meaningless.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import PaskError

CASES_FILE = "cases.jsonl"
RUN_FILE = "run.json"
# settings added after run.json files were written: missing in an old one means None (the default)
LATER_KEYS = ("policy", "catalog", "whole_prefill")
# per-case notes (``note_cases``): merged across resumed runs, never compared as settings
NOTE_KEYS = ("catalog_cases",)


def budget_key(budget: float | None) -> str:
    return "full" if budget is None else f"{budget:g}"


def record_key(case_id: str, method: str, budget: float | None) -> tuple[str, str, str]:
    return (case_id, method, budget_key(budget))


class ResultStore:
    def __init__(self, out_dir: Path, manifest: dict[str, Any]) -> None:
        self.dir = out_dir
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PaskError(f"cannot create output directory {out_dir}: {exc.strerror}") from None
        self.path = out_dir / CASES_FILE
        self._check_manifest(manifest)
        self.records: dict[tuple[str, str, str], dict[str, Any]] = {}
        if self.path.exists():
            for lineno, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    # a line cut short by an interrupted write: drop it, the case is redone
                    continue
                if not isinstance(rec, dict) or "id" not in rec:
                    raise PaskError(f"{self.path}:{lineno}: not a result record")
                self.records[record_key(rec["id"], rec["method"], rec["budget"])] = rec

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        path = self.dir / RUN_FILE
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                raise PaskError(f"{path} is unreadable; use another --out directory") from None
            diff = [k for k in manifest if (k in old or k in LATER_KEYS) and old.get(k) != manifest[k]]
            if diff:
                raise PaskError(f"{self.dir} holds results made with different settings ({', '.join(diff)}); "
                                "use another --out directory")
            manifest = {**manifest, **{k: old[k] for k in NOTE_KEYS if k in old}}
        path.write_text(json.dumps(manifest, indent=2) + "\n")

    def note_cases(self, key: str, entries: dict[str, Any]) -> None:
        """Merge per-case notes (case id -> what was run) into ``run.json`` under ``key``; a note that
        contradicts an earlier run's for the same case is refused (the finished case would not be
        the case asked for)."""
        path = self.dir / RUN_FILE
        data = json.loads(path.read_text())
        notes = data.setdefault(key, {})
        diff = [cid for cid, v in entries.items() if cid in notes and notes[cid] != v]
        if diff:
            raise PaskError(f"{self.dir} holds case {diff[0]!r} run with another {key} entry; use another "
                            "--out directory")
        notes.update(entries)
        path.write_text(json.dumps(data, indent=2) + "\n")

    def done(self, case_id: str, method: str, budget: float | None) -> bool:
        return record_key(case_id, method, budget) in self.records

    def add(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, ensure_ascii=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[record_key(rec["id"], rec["method"], rec["budget"])] = rec
