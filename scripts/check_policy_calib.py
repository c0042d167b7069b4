#!/usr/bin/env python
"""AST accuracy of PASK policies through the real engine on BFCL *calibration-split* cases (never the
eval split): Full KV, PASK with the hand-written prior, PASK with the shipped (or a given) policy.
A sanity check of a calibration, not the evaluation (that is ``pask-local eval`` on the eval split).

    .venv/bin/python scripts/check_policy_calib.py [--skip 24] [--cases 16] [--budget 0.33] [--policy FILE]

--skip N leaves out the first N cases of the calibration order (the ones ``calibrate --cases N``
measured), so the check runs on calib cases the policy was not fitted on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pask_local.calibration.cli import calib_cases

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.errors import PaskError
from pask_local.eval.checker import score_output
from pask_local.eval.prompting import make_task
from pask_local.llm import Model
from pask_local.models import default_model_path
from pask_local.policy.handwritten import handwritten_policy
from pask_local.policy.schema import Policy
from pask_local.policy.shipped import resolve_default_policy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--skip", type=int, default=24)
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--policy", type=Path, default=None, help="policy file (default: the shipped default)")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    model = Model(args.gguf or default_model_path())
    calibrated, warning = (Policy.load(args.policy), None) if args.policy else resolve_default_policy(model)
    if warning:
        print("note:", warning)
    cases = calib_cases(None)[args.skip:args.skip + args.cases]
    runs = {
        "full": Engine(model, make_method("full", model), EngineConfig(budget=1.0, max_tokens=args.max_tokens)),
        "pask/hand-written": Engine(model, make_method("pask", model, handwritten_policy(model.n_layer)),
                                    EngineConfig(budget=args.budget, max_tokens=args.max_tokens)),
        f"pask/{calibrated.kind}": Engine(model, make_method("pask", model, calibrated),
                                          EngineConfig(budget=args.budget, max_tokens=args.max_tokens)),
    }
    ok = {name: 0 for name in runs}
    t0 = time.time()
    for case in cases:
        task = make_task(case)
        row = []
        for name, engine in runs.items():
            try:
                res = engine.run(task.functions, task.request, parallel=task.parallel, examples=task.examples)
                valid = score_output(case, res.text).valid
            except PaskError as exc:
                valid = False
                print(f"  {case.id} {name}: {exc}", file=sys.stderr)
            ok[name] += valid
            row.append(f"{name}={'ok' if valid else 'x'}")
        print(f"{case.id:40s} " + " ".join(row), flush=True)
    print(f"\n{len(cases)} calib cases (skip {args.skip}), budget {args.budget}, {time.time() - t0:.0f} s")
    for name, n in ok.items():
        print(f"  {name:22s} {n}/{len(cases)} = {n / max(1, len(cases)):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
