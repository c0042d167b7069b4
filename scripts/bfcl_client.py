"""A client no one here wrote: BFCL's own multi-turn runner against `pask-local serve`.

bfcl-eval's ``OpenAICompletionsHandler`` (its OpenAI-compatible function-calling handler, pointed at
the server through ``OPENAI_BASE_URL``) plays BFCL multi-turn conversations: it sends the requests,
executes the calls in its own environments and feeds the results back, as it does for any hosted
model; BFCL's own evaluator (``_evaluate_single_multi_turn_entry``) scores them. The same
conversations are then played in-process (``pask_local.eval.multiturn`` with the engine) under the
same method and greedy decoding, and the two verdicts are set side by side.

    .venv/bin/python scripts/bfcl_client.py --model qwen2.5-coder-1.5b --limit 20 --out results/bfcl-client
    .venv/bin/python scripts/bfcl_client.py --model qwen2.5-coder-0.5b --ids multi_turn_base_0 --max-turns 1 \\
        --out /tmp/bc --no-in-process

The server is started here (``--method``, one slot, exact prefix reuse) unless ``--url`` names one.
Writes ``OUT/bfcl_client.jsonl`` (one verdict per conversation, resumable), the in-process records
in ``OUT/in_process/`` and ``OUT/summary.json``; prints a table. Bad input is one line, exit 1.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from loopback import free_port  # (scripts/ is on sys.path when run as a script)

from pask_local.errors import PaskError
from pask_local.eval.multiturn import engine_caller, run_multiturn, select_conversations
from pask_local.eval.multiturn_env import Conversation

EXE = str(Path(sys.executable).with_name("pask-local"))
SLOT_LEN = 16384  # tokens of the server's one slot, and of the in-process pool's
TEXT_KEPT = 200   # characters of a text reply the in-process record keeps (eval.multiturn)


def start_server(model: str, method: str, budget: float, log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [EXE, "serve", "--model", model, "--method", method, "--budget", str(budget), "--slots", "1",
           "--port", str(port), "--max-context", str(SLOT_LEN), "--max-tokens", "256", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PaskError(f"the server exited ({proc.returncode}): {log.read_text()[-300:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return url, proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise PaskError("the server did not start within 600 s")


def served_model(url: str, key: str) -> str:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def bfcl_verdict(handler: Any, conv: Conversation, max_turns: int | None) -> dict[str, Any]:
    """BFCL's handler plays the conversation against the server; scored as BFCL's evaluator does
    (``eval_runner._evaluate_single_multi_turn_entry``, whose module imports every hosted model's SDK:
    its steps are repeated here with BFCL's own decoder, emptiness test and ``multi_turn_checker``)."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response

    entry = copy.deepcopy(conv.entry)
    truth = conv.ground_truth
    if max_turns is not None:
        entry["question"] = entry["question"][:max_turns]
        truth = truth[:max_turns]
    t0 = time.perf_counter()
    result, meta = handler.inference(copy.deepcopy(entry), include_input_log=False, exclude_state_log=True)
    seconds = time.perf_counter() - t0
    if not isinstance(result, list) or len(result) != len(truth):  # an inference error, or force-terminated
        valid, error = False, "multi_turn:inference_error" if not isinstance(result, list) else \
            "multi_turn:force_terminated"
    else:
        decoded: list[list[list[str]]] = []
        for turn in result:
            steps = []
            for step in turn:
                try:
                    calls = handler.decode_execute(step, has_tool_call_tag=False)
                except Exception:  # as BFCL: a reply that is not a call (the model chatting) is skipped
                    continue
                if not is_empty_execute_response(calls):
                    steps.append(calls)
            decoded.append(steps)
        verdict = multi_turn_checker(decoded, truth, entry, conv.category, handler.model_name)
        valid, error = bool(verdict["valid"]), verdict.get("error_type")
    return {"id": conv.id, "category": conv.category, "correct": valid, "error_type": error,
            "seconds": round(seconds, 2), "turns": len(entry["question"]),
            "result": result if isinstance(result, list) else str(result),
            "input_tokens": meta.get("input_token_count") if isinstance(meta, dict) else None}


def run_bfcl(url: str, key: str, convs: list[Conversation], max_turns: int | None, out: Path) -> list[dict]:
    os.environ["OPENAI_BASE_URL"] = url + "/v1"
    os.environ["OPENAI_API_KEY"] = key
    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    model_id = served_model(url, key)
    handler = OpenAICompletionsHandler(model_name=model_id, temperature=0.0, registry_name=f"{model_id}-FC",
                                       is_fc_model=True)
    path = out / "bfcl_client.jsonl"
    done = {}
    if path.exists():
        done = {r["id"]: r for r in map(json.loads, path.read_text().splitlines()) if r.get("turns") is not None}
    rows = []
    for i, conv in enumerate(convs, 1):
        if conv.id in done:
            rows.append(done[conv.id])
            continue
        row = bfcl_verdict(handler, conv, max_turns)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        print(f"[bfcl {i}/{len(convs)}] {conv.id}: {'correct' if row['correct'] else 'wrong'} "
              f"({row['error_type'] or 'valid'}), {row['seconds']:.0f} s", flush=True)
    return rows


def bfcl_replies(row: dict) -> list | None:
    """The model's replies as BFCL's runner recorded them: per turn, per step, its calls
    ``[(name, arguments)]`` or its text."""
    if not isinstance(row.get("result"), list):
        return None
    turns = []
    for turn in row["result"]:
        steps: list = []
        for step in turn:
            if isinstance(step, list):
                steps.append([(name, json.loads(args)) for call in step for name, args in call.items()])
            else:
                steps.append(str(step)[:TEXT_KEPT].strip())
        turns.append(steps)
    return turns


def local_replies(rec: dict) -> list:
    """The same, from an in-process record (``eval.multiturn``)."""
    turns = []
    for turn in rec["turns"]:
        calls = iter(turn["calls"])
        turns.append([[(c["name"], c["arguments"]) for c in next(calls)] if r["n_calls"] else
                      (r["content"] or "").strip()[:TEXT_KEPT] for r in turn["replies"]])
    return turns


def read_bfcl(out: Path, convs: list[Conversation]) -> list[dict]:
    """The BFCL-runner verdicts already in ``OUT/bfcl_client.jsonl`` for ``convs`` (in their order)."""
    path = out / "bfcl_client.jsonl"
    done = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}
    return [done[c.id] for c in convs if c.id in done]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--url", help="a running pask-local serve (its /v1 is appended); default: start one")
    ap.add_argument("--api-key", default=os.environ.get("PASK_API_KEY", "unused"))
    ap.add_argument("--method", default="full")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--categories", default="multi_turn_base")
    ap.add_argument("--split", default="eval")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--ids", help="comma-separated conversation ids")
    ap.add_argument("--max-turns", type=int, help="play only each conversation's first N turns")
    ap.add_argument("--no-in-process", action="store_true", help="only BFCL's runner against the server")
    ap.add_argument("--no-bfcl", action="store_true",
                    help="only the in-process side (its verdicts are compared with OUT/bfcl_client.jsonl's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        convs = select_conversations([c.strip() for c in args.categories.split(",") if c.strip()], args.split,
                                     args.limit, [i.strip() for i in args.ids.split(",")] if args.ids else None)
        if args.max_turns is not None and args.max_turns < 1:
            raise PaskError(f"--max-turns must be at least 1, got {args.max_turns}")
        args.out.mkdir(parents=True, exist_ok=True)
        proc = None
        url = args.url
        if args.no_bfcl:
            bfcl = read_bfcl(args.out, convs)
        else:
            if url is None:
                url, proc = start_server(args.model, args.method, args.budget, args.out / "server.log")
            try:
                bfcl = run_bfcl(url.rstrip("/"), args.api_key, convs, args.max_turns, args.out)
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
        local: dict[str, dict] = {}
        if not args.no_in_process:
            from pask_local.models import resolve_model

            # the server's path: a one-slot pool of SLOT_LEN tokens with exact prefix reuse
            caller, close = engine_caller(resolve_model(None, args.model), args.method, args.budget,
                                          reuse_len=SLOT_LEN)
            try:
                recs = run_multiturn(convs, caller, args.out / "in_process", method=args.method,
                                     budget=None if args.method == "full" else args.budget,
                                     settings={"model": args.model}, max_turns=args.max_turns)
            finally:
                close()
            local = {r["id"]: r for r in recs}
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("| conversation | BFCL runner via serve | in-process | same replies |\n|---|---|---|---|")
    for r in bfcl:
        mine = local.get(r["id"])
        same = "-" if mine is None else ("yes" if bfcl_replies(r) == local_replies(mine) else "no")
        print(f"| {r['id']} | {'correct' if r['correct'] else 'wrong'} | "
              f"{'-' if mine is None else ('correct' if mine['correct'] else 'wrong')} | {same} |")
    summary = {"model": args.model, "method": args.method, "conversations": len(bfcl),
               "max_turns": args.max_turns, "bfcl_client_correct": sum(r["correct"] for r in bfcl),
               "in_process_correct": sum(r["correct"] for r in local.values()) if local else None,
               "agree": sum(local[r["id"]]["correct"] == r["correct"] for r in bfcl) if local else None,
               # the stronger check: every reply (each step's calls or text) the same on both paths
               "same_replies": sum(bfcl_replies(r) == local_replies(local[r["id"]]) for r in bfcl) if local else None,
               "turns": sum(r["turns"] for r in bfcl),
               "steps": sum(len(t) for r in bfcl for t in (bfcl_replies(r) or [])),
               "calls": sum(len(step) for r in bfcl for t in (bfcl_replies(r) or []) for step in t
                            if isinstance(step, list))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
