#!/usr/bin/env python3
"""Benchmark the layered KV cache against upstream's full cache on the same prompt, in one run.

For each context size (default 2048 and 4096 on Gemma 3 270M): a full upstream context and layered
contexts whose every layer holds ``fraction`` x the cells upstream gives that layer (n_ctx with
llama.cpp's default swa_full = true), at fractions 1.0, 0.5, 0.33. The prompt
(n_ctx minus the generated tokens) is prefilled in chunks; before each chunk, and before each
decoded token, every layer short of free cells evicts its oldest non-sink positions, so no layer
ever exceeds its capacity. Decode time is llama_decode's median and minimum over the generated
tokens, decoded round-robin (one token per configuration per round) so that machine noise hits every
configuration alike; the eviction bookkeeping is timed apart.

Usage: python scripts/bench_kv.py [--ctx 2048 4096] [--fractions 1.0 0.5 0.33] [--rounds 48]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from pask_local.kv_layered import LayeredContext, kv_total_bytes
from pask_local.llm import Context, ContextConfig, Model
from pask_local.models import default_model_path

N_SINK = 4
CHUNK = 256
TEXT = ("Entry {i}: the ferry from {a} to {b} left at {h}:{m:02d} with {n} passengers and {c} cars; "
        "the weather was {w}. ")
WEATHER = ["clear", "windy", "foggy", "rainy", "calm"]
PORTS = ["Arden", "Bexley", "Corran", "Dunmore", "Elgin", "Fintry"]


def prompt_tokens(model: Model, n: int) -> list[int]:
    text, i = "", 0
    toks: list[int] = []
    while len(toks) < n:
        text += "".join(TEXT.format(i=i + k, a=PORTS[(i + k) % 6], b=PORTS[(i + k + 2) % 6], h=(i + k) % 24,
                                    m=(7 * (i + k)) % 60, n=(31 * (i + k)) % 400, c=(i + k) % 37,
                                    w=WEATHER[(i + k) % 5]) for k in range(50))
        i += 50
        toks = model.tokenize(text, add_special=True)
    return toks[:n]


def full_cells_per_layer(model: Model, full: Context, n_ctx: int, n_ubatch: int) -> list[int]:
    """Cells the upstream context allocated per layer.

    llama.cpp's default (swa_full = true) gives every layer n_ctx cells; with swa_full = false the
    sliding-window layers of Gemma 3 get a window cache padded to 256. Which one applies is read off
    the upstream context's byte count (all layers of these models have the same bytes per cell).
    """
    per_cell = LayeredContext(model, [1] * model.n_layer, ContextConfig(n_ctx=256, n_batch=1)).kv_bytes()
    if kv_total_bytes(full) == per_cell * n_ctx:
        return [n_ctx] * model.n_layer
    window = int(model.meta(f"{model.arch}.attention.sliding_window") or 0)
    swa_cells = min(n_ctx, -(-(window + n_ubatch) // 256) * 256)
    # llama.cpp's Gemma 3 pattern: every 6th layer is global, the others slide
    cells = [n_ctx if (il + 1) % 6 == 0 else swa_cells for il in range(model.n_layer)]
    if kv_total_bytes(full) != per_cell * sum(cells):
        raise SystemExit("cannot tell how many cells upstream allocated per layer")
    return cells


@dataclass
class Run:
    name: str
    ctx: Context
    kv_bytes: int
    pos: int = 0
    prefill_s: float = 0.0
    decode_ms: list[float] = field(default_factory=list)
    evict_ms: list[float] = field(default_factory=list)


def make_room(ctx: LayeredContext, need: int) -> None:
    """Evict, per layer, the oldest non-sink positions until ``need`` cells are free."""
    for il in range(len(ctx.capacities)):
        short = need - ctx.free(il)
        if short > 0:
            held = sorted(p for p in ctx.positions(il) if p >= N_SINK)
            ctx.evict(il, held[:short])


def prefill(run: Run, toks: list[int]) -> None:
    t0 = time.perf_counter()
    for start in range(0, len(toks), CHUNK):
        part = toks[start:start + CHUNK]
        if isinstance(run.ctx, LayeredContext):
            make_room(run.ctx, len(part))
        rc = run.ctx.decode(part, start, logits="none")
        if rc != 0:
            raise SystemExit(f"{run.name}: prefill failed at {start} (status {rc})")
    run.pos = len(toks)
    run.prefill_s = time.perf_counter() - t0


def decode_round(run: Run, toks: list[int]) -> None:
    for t in toks:
        if isinstance(run.ctx, LayeredContext):
            e0 = time.perf_counter()
            make_room(run.ctx, 1)
            run.evict_ms.append((time.perf_counter() - e0) * 1e3)
        t0 = time.perf_counter()
        rc = run.ctx.decode([t], run.pos)
        run.decode_ms.append((time.perf_counter() - t0) * 1e3)
        if rc != 0:
            raise SystemExit(f"{run.name}: decode failed at {run.pos} (status {rc})")
        run.pos += 1


def bench_ctx(model: Model, n_ctx: int, fractions: list[float], rounds: int, per_round: int) -> list[Run]:
    n_gen = rounds * per_round
    config = ContextConfig(n_ctx=n_ctx, n_batch=CHUNK)
    toks = prompt_tokens(model, n_ctx - n_gen - 8)
    cont = prompt_tokens(model, n_gen + 40)[40:]
    full = Context(model, config)
    runs = [Run("full (upstream)", full, kv_total_bytes(full))]
    base = full_cells_per_layer(model, full, n_ctx, CHUNK)
    for f in fractions:
        caps = [max(N_SINK + CHUNK, round(f * c)) for c in base]
        lay = LayeredContext(model, caps, config)
        runs.append(Run(f"layered {f:.2f}", lay, lay.kv_bytes()))
    for run in runs:
        prefill(run, toks)
    for r in range(rounds):
        for run in runs:
            decode_round(run, cont[r * per_round:(r + 1) * per_round])
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.33])
    ap.add_argument("--rounds", type=int, default=48, help="round-robin rounds (one per configuration each)")
    ap.add_argument("--per-round", type=int, default=1, help="tokens per configuration per round")
    ap.add_argument("--gguf", default=None, help="model (default: the embedded Gemma 3 270M)")
    args = ap.parse_args()

    model = Model(args.gguf or default_model_path())
    print(f"model {model.path.name} ({model.arch}, {model.n_layer} layers); chunk {CHUNK}, sinks {N_SINK}, "
          f"{args.rounds}x{args.per_round} decoded tokens per configuration")
    verdicts = []
    for n_ctx in args.ctx:
        runs = bench_ctx(model, n_ctx, args.fractions, args.rounds, args.per_round)
        full = runs[0]
        full_ms = statistics.median(full.decode_ms)
        print(f"\nn_ctx {n_ctx}")
        full_min = min(full.decode_ms)
        print(f"{'cache':<18}{'K/V MiB':>9}{'x full':>8}{'decode ms/tok':>15}{'x full':>8}"
              f"{'min ms/tok':>12}{'x full':>8}{'evict ms/tok':>14}{'prefill s':>11}")
        for run in runs:
            ms = statistics.median(run.decode_ms)
            lo = min(run.decode_ms)
            ev = statistics.median(run.evict_ms) if run.evict_ms else 0.0
            print(f"{run.name:<18}{run.kv_bytes / 2**20:>9.1f}{run.kv_bytes / full.kv_bytes:>8.3f}"
                  f"{ms:>15.2f}{ms / full_ms:>8.3f}{lo:>12.2f}{lo / full_min:>8.3f}{ev:>14.3f}"
                  f"{run.prefill_s:>11.2f}")
        lowest = runs[-1]
        kv_ratio = lowest.kv_bytes / full.kv_bytes
        t_ratio = statistics.median(lowest.decode_ms) / full_ms
        verdicts.append(f"n_ctx {n_ctx}, {lowest.name}: K/V {kv_ratio:.3f}x full "
                        f"({'ok' if kv_ratio <= 0.36 else 'MISSED'} <= 0.36), median decode {t_ratio:.3f}x full "
                        f"({'ok' if t_ratio <= 1.0 else 'MISSED'} <= 1.0)")
    print("\ntargets:")
    for v in verdicts:
        print("  " + v)


if __name__ == "__main__":
    main()
