"""One prefill, several methods: the methods that read the whole prompt before they compress share it.

Full KV and the compress-after-prefill methods (SnapKV, PyramidKV, pask-attn) all prefill the whole
prompt, unchanged, before they evict anything; only their one-time compression and what follows
differs. ``run_shared`` prefills the prompt once, in sequence 0 of a layered context with one KV
stream shared by all sequences (``kv_unified``), with the attention probe observing the last chunk;
``llama_memory_seq_cp`` then gives every other method's sequence the same cells (no copy: a cell
carries several sequence ids), and each method compresses its own sequence from the same window
statistic (its native step, on its sequence id; compaction stays off, the cells are shared). The
methods then decode together, one token each per ``llama_decode``. Every layer holds the prompt
once plus each method's own generated tokens.

The first generated token of every method comes from the prefill's logits, as it does alone
(compression follows those logits); the prompt is cut into chunks as a compressing method cuts it
(its observation window in the last chunk), which for Full KV alone is a different cut. Afterwards each method attends only its own sequence's cells;
the numbers can differ from a run alone in the last bits (a different number of KV cells in the
attention, the same effect as a different ubatch cut: docs/fidelity.md).
"""

from __future__ import annotations

from ..attention import WINDOW, AttentionProbe, probed_layered_context
from ..errors import NativeError, PaskError
from ..methods import Method, PrefillMode
from .core import Engine, EngineResult, Prepared, SlotSpec, prefills_whole
from .kv_stream import context_config, round_up
from .run import Run


def shares_prefill(method: Method) -> bool:
    """Whether ``method`` prefills the whole prompt unchanged (Full KV, compress-after-prefill methods)."""
    return method.prefill_mode in (PrefillMode.NONE, PrefillMode.WHOLE_THEN_COMPRESS)


def run_shared(engines: list[Engine], prepared: list[Prepared], traces: list | None = None) -> list[EngineResult]:
    """Answer the same prompt with every engine's method from one prefill (see the module doc);
    ``traces``: a trace path (or None) per engine."""
    if not engines or len(engines) != len(prepared):
        raise PaskError("run_shared needs one prepared request per engine")
    model = engines[0].model
    tokens = prepared[0].plan.prompt.tokens
    for e, p in zip(engines, prepared, strict=True):
        if e.model is not model:
            raise PaskError("the engines of a shared prefill must share one model")
        if not shares_prefill(e.method):
            raise PaskError(f"method '{e.method.name}' changes the prompt's KV while it is read: it cannot "
                            f"share a prefill")
        if p.plan.prompt.tokens != tokens:
            raise PaskError("a shared prefill needs the same prompt tokens for every method")
        if e.cfg.kv_type != "f16" or e.cfg.chunk != engines[0].cfg.chunk or \
                e.cfg.probe_window != engines[0].cfg.probe_window:
            raise PaskError("the engines of a shared prefill need the same chunk, probe window and f16 KV")
    n, m = len(tokens), len(engines)
    cells = round_up(n + sum(e.cfg.max_tokens + 1 for e in engines) + engines[0].cfg.chunk)
    cfg0 = engines[0].cfg
    probe = AttentionProbe(model.n_layer, cfg0.probe_window) if any(e.method.needs_attention for e in engines) \
        else None
    cfgc = context_config(cells, max(cfg0.chunk, cfg0.probe_window, m), n_seq_max=m, kv_unified=True)
    ctx = probed_layered_context(model, [cells] * model.n_layer, cfgc, probe, unified=True, stats=(WINDOW,))
    runs: list[Run] = []
    try:
        kv_bytes = ctx.kv_bytes() // m
        for k, (e, p) in enumerate(zip(engines, prepared, strict=True)):
            spec = SlotSpec(ctx, k, [cells] * model.n_layer, kv_bytes, probe=probe)
            runs.append(e.start_in_slot(p, spec, trace=traces[k] if traces else None))
        lead = next((r for r in runs if prefills_whole(r.method)), runs[0])
        bounds = lead.prefill_bounds()  # a compressing method's cut: the window lies in the last chunk
        for a, b in bounds:
            if probe is not None:
                probe.reset()
            if ctx.decode(tokens[a:b], a, seq_id=0) != 0:
                raise NativeError(f"llama_decode failed on prompt tokens {a}..{b}")
        logits = ctx.logits()
        for k in range(1, m):
            ctx.seq_cp(0, k)
        for r in runs:
            r.after_chunk(bounds[-1][0], n)
            r.end_prefill()
        if probe is not None:
            probe.set_enabled(False)  # every method has its window statistic: no host copies while decoding
        live = {}
        for k, r in enumerate(runs):
            tok = r.next_token(logits)
            if tok is not None:
                live[k] = tok
        while live:
            seqs = sorted(live)
            if ctx.decode_batch([live[k] for k in seqs], [runs[k].pos for k in seqs], seqs, [True] * len(seqs)) != 0:
                raise NativeError(f"llama_decode failed on a batch of {len(seqs)} methods' tokens")
            for row, k in enumerate(seqs):
                runs[k].after_token()
                tok = runs[k].next_token(ctx.logits(row))
                if tok is None:
                    del live[k]
                else:
                    live[k] = tok
        results = [r.result() for r in runs]
        for res in results:
            res.stats["shared_prefill"] = m
        return results
    finally:
        for r in runs:
            r.close()
        ctx.close()
        if probe is not None:
            probe.close()
