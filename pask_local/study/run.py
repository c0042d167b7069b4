"""``pask-local study run``: the whole method study in N processes of one thread each, resumable,
then one merged table.

The (method, budget) runs are split into jobs, each a ``pask-local eval`` process with its own
output directory under OUT (``OUT/<job>``):

- one job for every method that prefills the whole prompt before it compresses (SnapKV, PyramidKV,
  pask-hybrid, pask-attn: one prefill per case shared by all of them at every budget);
- one job per other (method, budget), Full KV included (a method that evicts while it reads the
  prompt needs a prefill of its own).

``--jobs N`` workers take the jobs in that order (the shared job first: it is the longest). A job's
directory resumes an interrupted run, so rerunning the same command continues the study, and a
larger ``--limit`` adds cases. At the end the records are merged (``pask_local.eval.study``) on the
cases every run holds: ``OUT/study.json``, ``OUT/study.md``, ``OUT/study.png``.

With ``--fidelity`` after ``--`` every run is a job of its own (teacher-forced runs do not share a
prefill) and all jobs share Full KV's references in ``OUT/fidelity_ref`` (computed once per case,
under a lock); the table adds the fidelity columns and their pairing with the best baseline.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import PaskError
from ..eval.fidelity import REF_DIR
from ..eval.study import build_study, load_dirs, markdown, plot


@dataclass(frozen=True)
class Job:
    name: str
    methods: tuple[str, ...]
    budgets: tuple[str, ...]


def plan_jobs(model_path: Path, methods: list[str], budgets: list[str], share: bool = True) -> list[Job]:
    """Jobs in the order workers take them: the shared-prefill job first, then one per run.

    ``share=False`` (a ``--fidelity`` study: its teacher-forced runs cannot share a prefill) gives
    every (method, budget) a job of its own, so the workers stay balanced."""
    from ..engine import make_method
    from ..engine.shared import shares_prefill
    from ..llm import Model
    from ..methods import METHOD_NAMES

    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown:
        raise PaskError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(METHOD_NAMES)})")
    model = Model(model_path)
    try:
        kinds = {m: make_method(m, model) for m in dict.fromkeys(methods)}
    finally:
        model.close()
    shared = tuple(m for m, k in kinds.items() if share and shares_prefill(k) and not k.keeps_all)
    if len(shared) * len(budgets) < 2:  # one run shares nothing: it is a job like any other
        shared = ()
    jobs = [Job("shared", shared, tuple(budgets))] if shared else []
    for m, k in kinds.items():
        if k.keeps_all:
            jobs.append(Job(m, (m,), ("1",)))
        elif m not in shared:
            jobs += [Job(f"{m}-{b}", (m,), (b,)) for b in budgets]
    return jobs


def _records(d: Path) -> int:
    try:
        with open(d / "cases.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run_jobs(jobs: list[Job], base_args: list[str], out: Path, n_workers: int) -> list[tuple[Job, int]]:
    """Run every job with ``n_workers`` one-thread processes; the exit status of each job."""
    todo: queue.Queue[Job] = queue.Queue()
    for j in jobs:
        todo.put(j)
    results: list[tuple[Job, int]] = []
    lock = threading.Lock()
    env = {**os.environ, "PASK_THREADS": "1"}

    def worker() -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            d = out / job.name
            d.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pask_local.cli", "eval", *base_args, "--methods", ",".join(job.methods),
                   "--budgets", ",".join(job.budgets), "--out", str(d)]
            t0 = time.time()
            with open(d / "log.txt", "a", encoding="utf-8") as log:
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            with lock:
                results.append((job, rc))
                status = "done" if rc == 0 else f"FAILED (exit {rc}; see {d / 'log.txt'})"
                print(f"[study] {job.name}: {status} in {time.time() - t0:.0f} s, {_records(d)} records",
                      file=sys.stderr, flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, n_workers))]
    for t in threads:
        t.start()
    t0 = time.time()
    while any(t.is_alive() for t in threads):
        time.sleep(2)
        if time.time() - t0 >= 60:
            t0 = time.time()
            counts = ", ".join(f"{j.name} {_records(out / j.name)}" for j in jobs if (out / j.name).is_dir())
            print(f"[study] records so far: {counts}", file=sys.stderr, flush=True)
    return results


def run_study(model: str | None, gguf: str | None, methods: str, budgets: str, limit: int | None, split: str,
              categories: str | None, n_jobs: int, out: Path, extra: list[str]) -> tuple[str, list[str]]:
    """Plan, run and merge the study; writes ``OUT/study.json``, ``.md``, ``.png``. Returns the table
    and the names of the jobs that failed. ``KeyboardInterrupt`` passes through (rerun to resume)."""
    from ..eval.runner import parse_budgets
    from ..models import resolve_model

    path = resolve_model(gguf, model)
    budget_list = [f"{b:g}" for b in parse_budgets(budgets)]
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    if n_jobs < 1:
        raise PaskError(f"--jobs must be >= 1, got {n_jobs}")
    fidelity = "--fidelity" in extra
    jobs = plan_jobs(path, method_list, budget_list, share=not fidelity)
    base = ["--gguf", str(path), "--split", split, *extra]
    if fidelity and not any(a.startswith("--fidelity-refs") for a in extra):
        base += ["--fidelity-refs", str(out / REF_DIR)]  # Full KV's references, one per case for all jobs
    if limit is not None:
        base += ["--limit", str(limit)]
    if categories:
        base += ["--categories", categories]
    out.mkdir(parents=True, exist_ok=True)
    print(f"[study] {len(jobs)} job(s) on {n_jobs} worker(s): " + ", ".join(j.name for j in jobs),
          file=sys.stderr, flush=True)
    t0 = time.time()
    results = run_jobs(jobs, base, out, n_jobs)
    failed = [j.name for j, rc in results if rc != 0]
    _, records = load_dirs([out / j.name for j in jobs])
    study = build_study(records)
    study["wall_seconds"] = round(time.time() - t0, 1)
    study["jobs"] = [{"name": j.name, "methods": list(j.methods), "budgets": list(j.budgets)} for j in jobs]
    table = markdown(study)
    (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    (out / "study.md").write_text(table)
    plot(study, out / "study.png")
    return table, failed
