"""Benchmark: the eval harness's prefix cache vs re-prefilling every prompt (Full KV, same cases).

Runs the same evaluation cases through ``FullKVGenerator`` twice, once reusing the KV of the longest
common token prefix with the previous case and once prefilling every prompt from scratch, and
prints prompt tokens, tokens reused, prefill seconds and whole-case seconds of both, their ratios,
and whether the outputs are identical.

    .venv/bin/python scripts/bench_eval_prefix.py --category simple_python --n 8
"""

from __future__ import annotations

import argparse
import time

from pask_local.eval.data import load_bundled
from pask_local.eval.generator import GeneratorSpec, make_generator
from pask_local.eval.split import split_of
from pask_local.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--category", default="simple_python")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cases = [c for c in load_bundled(args.category) if split_of(c.id) == "eval"][: args.n]
    results = {}
    for reuse in (True, False):
        gen = make_generator("full", GeneratorSpec(default_model_path(), max_tokens=args.max_tokens, reuse_prefix=reuse))
        t0 = time.perf_counter()
        outs = [gen.generate(c) for c in cases]
        wall = time.perf_counter() - t0
        gen.close()
        results[reuse] = (outs, wall)
        print(f"reuse={reuse!s:5}  cases={len(outs)}  prompt_tokens={sum(o.n_prompt for o in outs)}  "
              f"reused={sum(o.n_reused for o in outs)}  prefill_s={sum(o.prefill_seconds for o in outs):.2f}  "
              f"wall_s={wall:.2f}")
    (a, wa), (b, wb) = results[True], results[False]
    pa, pb = sum(o.prefill_seconds for o in a), sum(o.prefill_seconds for o in b)
    print(f"prefill time ratio (reuse / no reuse): {pa / pb:.3f}   wall ratio: {wa / wb:.3f}")
    print(f"identical outputs: {sum(x.text == y.text for x, y in zip(a, b, strict=True))}/{len(a)}")


if __name__ == "__main__":
    main()
