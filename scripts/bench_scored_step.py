#!/usr/bin/env python3
"""The decode step of a scored query-agnostic method (kvzip, knorm, ...): native step vs the Python
reference rule, in one run, behind a tool catalog.

One eval-split simple_python case is put behind a catalog of about ``--catalog-tokens`` tokens
(``eval.catalog``), then answered by each method at budget 0.33 twice: with the native step
(``EngineConfig.native_step``, the default) and with the Python reference rule. Prints, per run, the
step's milliseconds per generated token (the bookkeeping and eviction alone), the whole time per
token, the prompt length and the tokens generated, as JSON.

Usage: PASK_THREADS=1 python scripts/bench_scored_step.py [--model qwen2.5-coder-0.5b]
       [--catalog-tokens 4000] [--methods kvzip]
"""

from __future__ import annotations

import argparse
import json

from bench_prefix import catalog_case  # (scripts/ is on sys.path when run as a script)

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.eval.prompting import make_task
from pask_local.llm import Model
from pask_local.models import named_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--catalog-tokens", type=int, default=4000)
    ap.add_argument("--methods", default="kvzip")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    model = Model(named_model_path(args.model))
    task = make_task(catalog_case(model, args.catalog_tokens, examples=True), True)
    out = {}
    for method in args.methods.split(","):
        for native in (True, False):
            cfg = EngineConfig(budget=0.33, max_tokens=args.max_tokens, native_step=native, style="native")
            res = Engine(model, make_method(method, model), cfg).chat(
                task.conversation(), task.functions, "required", parallel=task.parallel, examples=task.examples)
            out[f"{method} native_step={native}"] = {
                k: round(res.stats[k], 3) for k in ("step_ms_per_token", "ms_per_token", "n_prompt", "n_gen")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
