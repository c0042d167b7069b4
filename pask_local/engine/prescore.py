"""Scoring passes that run before a request's prefill, for methods that declare ``prompt_scorer``.

A pass reads prompt positions [0, obs_end) (the part before the user's turn, ``ScoredMethod.obs_end``)
in a layered context of its own with the in-graph attention probe, and returns per layer one score
per prompt position (0 from obs_end on). The last few passes are kept by what they read, so the
requests behind one catalog share one pass. The request's own prefill then runs as usual and evicts
while it reads by those scores, so the pass costs one extra prefill of the prefix (two for
``reconstruction``), paid once when the prefix is compressed once (``pask-local compress``).

- ``window-before-query``: the attention the prefix's last ``window`` queries pay each entry (SnapKV's
  statistic with the observation window at the prefix's own tail).
- ``reconstruction``: the prefix is read, then re-presented after an instruction to repeat it; each
  entry's score is the attention mass every query of the repetition pays it, summed over queries and
  heads (KVzip's reconstruction idea, read per layer). ``kvzip`` and ``pask-zip`` (PASK's
  ``reconstruction`` order) declare it with the same instruction: behind one catalog they share a pass.
- ``key-norm``: no attention at all: each entry's key norm, read from the cache's saved K rows
  (``kv_rows``); KNorm keeps the keys of lowest norm.
- ``key-diff``: no attention either: each key's cosine similarity to its head's mean unit key over the
  prefix (the anchor); KeyDiff keeps the keys least similar to it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ..attention import SUM, WINDOW, AttentionProbe, cell_positions, probed_layered_context
from ..errors import NativeError
from ..kv_rows import key_rows
from ..llm import Model
from ..methods.base import Method
from ..methods.scored import SnapKVPrefix
from .kv_stream import context_config, flash_attn_for
from .types import EngineConfig

# a method that declares ``prompt_scorer`` (and, for the pass that reads them, ``window`` / ``instruction``)
Scorer = Callable[[Model, Method, list[int], EngineConfig], list[np.ndarray]]


def _context(model: Model, n_cells: int, cfg: EngineConfig, probe: AttentionProbe, stat: int):
    """A layered context for the pass; ``cfg.graph_stats`` False: the probe reads the softmax from an
    eval callback instead (the reference the in-graph statistics are tested against)."""
    cells = -(-n_cells // cfg.cell_align) * cfg.cell_align
    flash = flash_attn_for(cfg.kv_type, cfg.flash_attn, host_probe=not cfg.graph_stats)
    cfgc = context_config(cells, max(cfg.chunk, cfg.probe_window), cfg.kv_type, flash)
    return probed_layered_context(model, [cells] * model.n_layer, cfgc, probe, stats=(stat,),
                                  in_graph=cfg.graph_stats)


def _add(scores: list[np.ndarray], probe: AttentionProbe, ctx, stat: int, limit: int) -> None:
    """Add the probe's statistic of the last decode to each layer's scores of positions < limit."""
    for il, layer in enumerate(scores):
        s = probe.stat(il, stat)
        cells = cell_positions(ctx, il)
        n = min(len(s), len(cells))
        ok = (cells[:n] >= 0) & (cells[:n] < limit)
        np.add.at(layer, cells[:n][ok], s[:n][ok])


def _decode(ctx, tokens: list[int], pos0: int, chunk: int, probe: AttentionProbe | None = None,
            each: Callable[[], None] | None = None) -> None:
    for a in range(0, len(tokens), chunk):
        if probe is not None:
            probe.reset()
        if ctx.decode(tokens[a:a + chunk], pos0 + a) != 0:
            raise NativeError(f"llama_decode failed in a scoring pass at position {pos0 + a}")
        if each is not None:
            each()


def window_before_query(model: Model, method: Method, prefix: list[int], cfg: EngineConfig
                        ) -> list[np.ndarray]:
    assert isinstance(method, SnapKVPrefix)
    n, window = len(prefix), max(1, method.window)
    scores = [np.zeros(n) for _ in range(model.n_layer)]
    probe = AttentionProbe(model.n_layer, window)
    ctx = _context(model, n + 1, cfg, probe, WINDOW)
    try:
        head = max(0, n - max(window, cfg.chunk))  # the last decode holds the whole window
        probe.set_enabled(False)
        _decode(ctx, prefix[:head], 0, cfg.chunk)
        probe.set_enabled(True)
        probe.reset()
        if ctx.decode(prefix[head:], head) != 0:
            raise NativeError("llama_decode failed on the observation window of a scoring pass")
        _add(scores, probe, ctx, WINDOW, n)
    finally:
        ctx.close()
        probe.close()
    return scores


def reconstruction(model: Model, method: Method, prefix: list[int], cfg: EngineConfig) -> list[np.ndarray]:
    n = len(prefix)
    instruction: str = method.instruction  # type: ignore[attr-defined]
    again = model.tokenize(instruction) + list(prefix[1:] if prefix and prefix[0] == _bos(model) else prefix)
    scores = [np.zeros(n) for _ in range(model.n_layer)]
    probe = AttentionProbe(model.n_layer, cfg.probe_window)
    ctx = _context(model, n + len(again) + 1, cfg, probe, SUM)
    try:
        probe.set_enabled(False)
        _decode(ctx, prefix, 0, cfg.chunk)
        probe.set_enabled(True)
        _decode(ctx, again, n, cfg.chunk, probe, lambda: _add(scores, probe, ctx, SUM, n))
    finally:
        ctx.close()
        probe.close()
    return scores


def _prefix_keys(model: Model, prefix: list[int], cfg: EngineConfig) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per layer, the prefix's cached keys as (positions, [entries, KV heads, head_dim]) (None: a layer
    whose K rows the save does not hold), read from a plain prefill's saved state (``kv_rows``)."""
    from ..kv_layered import LayeredContext
    from ..prefix import state as kv_state

    n = len(prefix)
    cells = -(-(n + 1) // cfg.cell_align) * cfg.cell_align
    ctx = LayeredContext(model, [cells] * model.n_layer,
                         context_config(cells, cfg.chunk, cfg.kv_type, flash_attn_for(cfg.kv_type, cfg.flash_attn)))
    try:
        _decode(ctx, prefix, 0, cfg.chunk)
        rows = key_rows(kv_state.save(ctx, 0)[1:])  # [1:]: the save's kind tag
    finally:
        ctx.close()
    head_dim = _head_dim(model)
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for il, layer in enumerate(rows):
        if layer is None:
            out.append(None)
            continue
        pos, k = layer
        if k.shape[1] % head_dim:
            raise NativeError(f"layer {il}: K rows of {k.shape[1]} values are not heads of {head_dim}")
        ok = pos < n
        out.append((pos[ok], k[ok].reshape(int(ok.sum()), -1, head_dim).astype(np.float64)))
    return out


def key_norm(model: Model, method: Method, prefix: list[int], cfg: EngineConfig) -> list[np.ndarray]:
    """Minus each entry's key norm (L2 per KV head, averaged over heads): low-norm keys rank first."""
    scores = [np.zeros(len(prefix)) for _ in range(model.n_layer)]
    for layer, keys in zip(scores, _prefix_keys(model, prefix, cfg), strict=True):
        if keys is not None:
            pos, k = keys
            layer[pos] = -np.linalg.norm(k, axis=2).mean(axis=1)
    return scores


def key_diff(model: Model, method: Method, prefix: list[int], cfg: EngineConfig) -> list[np.ndarray]:
    """Minus each key's cosine similarity to its head's anchor (the mean of the prefix's unit keys),
    averaged over a layer's KV heads: the keys least like the rest rank first (KeyDiff)."""
    eps = 1e-12
    scores = [np.zeros(len(prefix)) for _ in range(model.n_layer)]
    for layer, keys in zip(scores, _prefix_keys(model, prefix, cfg), strict=True):
        if keys is None or not len(keys[0]):
            continue
        pos, k = keys
        unit = k / np.maximum(np.linalg.norm(k, axis=2, keepdims=True), eps)
        anchor = unit.mean(axis=0)                                   # [heads, head_dim]
        anchor /= np.maximum(np.linalg.norm(anchor, axis=1, keepdims=True), eps)
        layer[pos] = -np.einsum("nhd,hd->nh", unit, anchor).mean(axis=1)
    return scores


def _head_dim(model: Model) -> int:
    arch = model.arch
    key = model.meta(f"{arch}.attention.key_length")
    if key:
        return int(key)
    return int(model.meta(f"{arch}.embedding_length") or 0) // int(model.meta(f"{arch}.attention.head_count") or 1)


def _bos(model: Model) -> int | None:
    toks = model.tokenize("", add_special=True)
    return toks[0] if toks else None


SCORERS: dict[str, Scorer] = {"window-before-query": window_before_query, "reconstruction": reconstruction,
                               "key-norm": key_norm, "key-diff": key_diff}
# what each pass reads of its method besides the prompt (its memo key): two methods that declare the
# same pass with the same values share it
READS: dict[str, tuple[str, ...]] = {"window-before-query": ("window",), "reconstruction": ("instruction",),
                                     "key-norm": (), "key-diff": ()}


# The last few passes, by what they read: requests behind the same catalog (an eval group, a server's
# agents, the budgets of one prefix) share one pass. A pass is deterministic, so a hit is exact.
_MEMO: OrderedDict[tuple, list[np.ndarray]] = OrderedDict()
_MEMO_SIZE = 4
_MEMO_LOCK = threading.Lock()


def _memo_key(model: Model, method: Method, prefix: list[int], cfg: EngineConfig) -> tuple:
    rule = (method.prompt_scorer, *(getattr(method, a) for a in READS[method.prompt_scorer]))
    setup = (cfg.chunk, cfg.probe_window, cfg.cell_align, cfg.kv_type, cfg.flash_attn, cfg.graph_stats)
    return (model.path, rule, setup, hashlib.sha256(np.asarray(prefix, dtype=np.int64).tobytes()).hexdigest())


def prompt_scores(model: Model, method: Method, tokens: list[int], obs_end: int, cfg: EngineConfig
                  ) -> list[np.ndarray]:
    """Per layer, a score for each of the ``len(tokens)`` prompt positions (0 from ``obs_end`` on)."""
    scorer = SCORERS.get(method.prompt_scorer)
    if scorer is None:
        raise NativeError(f"method {method.name}: unknown scoring pass {method.prompt_scorer!r}")
    n, prefix = len(tokens), list(tokens[:obs_end])
    key = _memo_key(model, method, prefix, cfg)
    with _MEMO_LOCK:
        part = _MEMO.get(key)
        if part is not None:
            _MEMO.move_to_end(key)
    if part is None:
        part = scorer(model, method, prefix, cfg)
        with _MEMO_LOCK:
            _MEMO[key] = part
            while len(_MEMO) > _MEMO_SIZE:
                _MEMO.popitem(last=False)
    return [np.concatenate([s, np.zeros(n - len(s))]) for s in part]
