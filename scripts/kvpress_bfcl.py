#!/usr/bin/env python
"""BFCL accuracy of transformers + PASKPress against pask-local's own engine on the same cases (issue 42).

Four runs over the same eval-split cases (default: the first 5 of simple_python, multiple, parallel,
parallel_multiple = 20): pask-local's ``eval`` (Full KV and its default PASK method at ``--budget``,
llama.cpp, Q4_K_M weights) and transformers (the same GGUF loaded with ``gguf_file=``, dequantized to
float32) with Full KV and with ``PASKPress(compression_ratio=1 - budget)``. Both sides render the
prompt with pask-local's renderer (identical token ids, checked per case), decode greedily under
pask-local's call grammar (``chat.decoder.Decoder`` fed the transformers logits), read the output
with the same parser and score it with BFCL's AST checker. Prints a table and the exact paired
comparison (per case: right/wrong on each side) and writes ``OUT/kvpress_bfcl.json``.

    PASK_THREADS=1 .venv/bin/python scripts/kvpress_bfcl.py --out results/kvpress-bfcl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pask_local.engine import EngineConfig
from pask_local.eval.checker import score_output
from pask_local.eval.prompting import checker_text, make_task, task_plan
from pask_local.eval.runner import EvalConfig, select_cases
from pask_local.eval.store import record_key
from pask_local.methods.registry import DEFAULT_METHOD


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--categories", default="simple_python,multiple,parallel,parallel_multiple")
    ap.add_argument("--limit", type=int, default=5, help="cases per category (first N of the eval split)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("results/kvpress-bfcl"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    return ap.parse_args()


def run_pask_local(args: argparse.Namespace, out: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """pask-local's own eval (resumable: a finished run only re-reports); its records by key."""
    exe = Path(sys.executable).with_name("pask-local")
    cmd = [str(exe), "eval", "--model", args.model, "--methods", f"full,{DEFAULT_METHOD}",
           "--budgets", f"{args.budget:g}", "--categories", args.categories, "--limit", str(args.limit),
           "--max-tokens", str(args.max_tokens), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PASK_THREADS": os.environ.get("PASK_THREADS", "1")})
    recs = {}
    for line in (out / "cases.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[record_key(r["id"], r["method"], r["budget"])] = r
    return recs


def hf_generate(model: Any, llama: Any, plan: Any, press: Any, max_tokens: int) -> tuple[str, str, int, list[int]]:
    """Greedy decoding of ``plan`` on the transformers model under pask-local's call grammar:
    (raw text, finish reason, generated tokens, cache entries per layer after the prefill)."""
    from transformers import DynamicCache

    from pask_local.chat.decoder import Decoder, decode_loop

    ids = torch.tensor([plan.prompt.tokens])
    decoder = Decoder(llama, plan)
    cache = DynamicCache()
    pos = len(plan.prompt.tokens)

    def step(tok: int) -> Any:
        nonlocal pos
        # positions continue the prompt's: the compressed cache is shorter than the sequence
        logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[pos]])).logits
        pos += 1
        return logits[0, -1].float().numpy()

    with torch.no_grad():
        try:
            with press(model) if press is not None else contextlib.nullcontext():
                logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
        except BaseException:
            decoder.close()
            raise
        held = [layer.keys.shape[2] for layer in cache.layers]
        out, finish = decode_loop(decoder, llama, logits[0, -1].float().numpy(), step, max_tokens)
    return llama.detokenize(out, special=True), finish, len(out), held


def paired(a: list[bool], b: list[bool]) -> dict[str, int]:
    return {"both_right": sum(x and y for x, y in zip(a, b, strict=True)),
            "both_wrong": sum(not x and not y for x, y in zip(a, b, strict=True)),
            "left_only": sum(x and not y for x, y in zip(a, b, strict=True)),
            "right_only": sum(y and not x for x, y in zip(a, b, strict=True))}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pask_local.kvpress import HFVocab, PASKPress, gguf_tokenizer
    from pask_local.llm import Model
    from pask_local.models import resolve_model

    hf_logging.disable_progress_bar()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = resolve_model(None, args.model)
    pask_recs = run_pask_local(args, args.out / "pask-local")
    cases = select_cases(EvalConfig(gguf=gguf, out=args.out, categories=args.categories.split(","),
                                    limit=args.limit))
    llama = Model(gguf)  # the grammar's vocabulary and the end-of-generation test, as in pask-local's eval
    tokenizer = gguf_tokenizer(gguf)
    vocab = HFVocab(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    bounds = EngineConfig()
    runs = {"hf_full": None, "hf_pask": PASKPress(compression_ratio=1 - args.budget)}
    rows = []
    for case in cases:
        task = make_task(case)
        plan = task_plan(llama, task, "auto", bounds.max_string, bounds.max_calls)
        hf_prompt = task_plan(vocab, task, "auto", bounds.max_string, bounds.max_calls).prompt
        if hf_prompt.tokens != plan.prompt.tokens or hf_prompt.classes != plan.prompt.classes:
            raise SystemExit(f"{case.id}: the HF tokenizer's tagged prompt differs from the GGUF's")
        row: dict[str, Any] = {"id": case.id, "category": case.category, "n_prompt": len(plan.prompt.tokens)}
        for name, press in runs.items():
            if press is not None:
                press.bind(hf_prompt.classes, hf_prompt.tokens)
            t0 = time.perf_counter()
            raw, finish, n_gen, held = hf_generate(model, llama, plan, press, args.max_tokens)
            text, _ = checker_text(plan, raw, finish, args.max_tokens)
            score = score_output(case, text)
            row[name] = {"valid": score.valid, "error_type": score.error_type, "output": text, "finish": finish,
                         "n_gen": n_gen, "held_after_prefill": sorted(set(held)), "seconds": time.perf_counter() - t0}
        for name, (method, budget) in {"pl_full": ("full", None), "pl_pask": (DEFAULT_METHOD, args.budget)}.items():
            r = pask_recs[record_key(case.id, method, budget)]
            row[name] = {"valid": bool(r["valid"]), "error_type": r.get("error_type"), "output": r["output"]}
        rows.append(row)
        print(case.id, row["n_prompt"], *(f"{k}={'ok' if row[k]['valid'] else '--'}"
                                          for k in ("pl_full", "pl_pask", "hf_full", "hf_pask")), flush=True)
    systems = ("pl_full", "pl_pask", "hf_full", "hf_pask")
    valid = {s: [r[s]["valid"] for r in rows] for s in systems}
    same_out = {f"{a}~{b}": sum(r[a]["output"] == r[b]["output"] for r in rows)
                for a, b in (("hf_pask", "pl_pask"), ("hf_full", "pl_full"), ("hf_pask", "hf_full"),
                             ("pl_pask", "pl_full"))}
    summary = {
        "model": args.model, "budget": args.budget, "pask_local_method": DEFAULT_METHOD, "n_cases": len(rows),
        "accuracy": {s: sum(v) / len(v) for s, v in valid.items()}, "correct": {s: sum(v) for s, v in valid.items()},
        "paired": {f"{a}_vs_{b}": paired(valid[a], valid[b])
                   for a, b in (("hf_pask", "pl_pask"), ("hf_full", "pl_full"), ("hf_pask", "hf_full"),
                                ("pl_pask", "pl_full"))},
        "identical_outputs": same_out,
    }
    (args.out / "kvpress_bfcl.json").write_text(json.dumps({"summary": summary, "cases": rows}, indent=1))
    print(f"\n{len(rows)} cases, budget {args.budget:g} ({DEFAULT_METHOD} in pask-local, PASKPress in transformers)")
    print(f"{'system':32} {'correct':>8} {'accuracy':>9}")
    labels = {"pl_full": "pask-local Full KV (llama.cpp)", "pl_pask": f"pask-local {DEFAULT_METHOD}",
              "hf_full": "transformers Full KV", "hf_pask": "transformers + PASKPress"}
    for s in systems:
        print(f"{labels[s]:32} {summary['correct'][s]:>8} {summary['accuracy'][s]:>9.1%}")
    print("paired (left vs right):", json.dumps(summary["paired"]))
    print("identical outputs:", json.dumps(same_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
