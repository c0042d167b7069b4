"""A request's K/V stream: how many cells each layer gets, and the context (or pool slot) that holds them.

The one sizing rule (``layer_cells``) serves the engine's own allocation and the pool's slot layout
(``pool.slot_capacities``); ``flash_attn_for`` is the one place that turns flash attention on for a
quantized cache; ``context_config`` is the one builder of a ``ContextConfig`` for engine contexts.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from ..attention import AttentionProbe, probed_layered_context
from ..errors import PaskError
from ..kv_layered import kv_total_bytes
from ..llm import Context, ContextConfig, Model
from .types import EngineConfig, SlotSpec

KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # name -> ggml_type
CELL_ALIGN = EngineConfig.cell_align


def kv_type_id(name: str) -> int:
    """The ggml_type of a KV cache type name (a PaskError names the choices)."""
    if name not in KV_TYPES:
        raise PaskError(f"unknown KV cache type '{name}' (choose from {', '.join(KV_TYPES)})")
    return KV_TYPES[name]


def round_up(n: int, align: int = CELL_ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (cells: upstream pads n_ctx the same way)."""
    return -(-n // align) * align if align > 1 else n


def flash_attn_for(kv_type: str, flash_attn: bool = False, host_probe: bool = False) -> bool:
    """Whether a context runs flash attention: asked for, or forced by a quantized V cache (llama.cpp
    needs it there). ``host_probe``: an eval-callback probe reads the softmax, which flash attention
    does not materialise, so it stays off (``Engine`` refuses a quantized cache with such a probe)."""
    return (flash_attn or kv_type != "f16") and not host_probe


def context_config(n_ctx: int, n_batch: int, kv_type: str = "f16", flash_attn: bool = False,
                   n_seq_max: int = 1, kv_unified: bool = False) -> ContextConfig:
    """The ``ContextConfig`` of an engine context (own run, pool, shared prefill, measurement)."""
    kv = kv_type_id(kv_type)
    return ContextConfig(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, kv_unified=kv_unified,
                         flash_attn=flash_attn, type_k=kv, type_v=kv)


def grown(cap: int, n_prompt: int, n_gen: int) -> int:
    """Entries a layer of prompt capacity ``cap`` may hold after ``n_gen`` generated tokens: its budget
    grows with the sequence (cap / n_prompt per token). The evictors' targets use the same number."""
    return cap + math.ceil(cap / n_prompt * n_gen - 1e-9)


def full_size(il: int, n_tokens: int, swa: Collection[int], window: int) -> int:
    """What full KV holds in layer il after ``n_tokens`` (a sliding-window layer: at most its window)."""
    if il in swa and window > 0:
        return min(n_tokens, window)
    return n_tokens


@dataclass(frozen=True)
class Cells:
    needed: list[int]   # cells per layer the stream needs
    cells: list[int]    # allocated: rounded up to the cell alignment


def layer_cells(n_layer: int, prompt_caps: Sequence[int] | None, n_prompt: int, max_tokens: int, chunk: int,
                swa: Collection[int] = (), window: int = 0, swa_slack: int | None = None,
                align: int = CELL_ALIGN) -> Cells:
    """Cells per layer of one K/V stream (the engine's own context and the pool's slots).

    ``prompt_caps`` None: every layer holds the whole sequence (Full KV, compress-after-prefill
    methods); else layer il holds its prompt capacity grown over ``max_tokens`` plus one ``chunk`` in
    flight (``grown``). A sliding-window layer never needs more than its window + ``swa_slack``
    (default ``chunk``: the longest chunk in flight). Every count is rounded up to ``align``, as
    upstream pads n_ctx: equal padding keeps budget 1.0 equal to Full KV bit for bit, and the GPU
    kernels need n_kv % 256 == 0 (the bytes it costs are reported: ``kv_bytes_alignment``).
    """
    max_len = n_prompt + max_tokens
    if prompt_caps is None:
        wanted = [max_len] * n_layer
    else:
        wanted = [min(max_len, grown(c, n_prompt, max_tokens) + chunk) for c in prompt_caps]
    slack = chunk if swa_slack is None else swa_slack
    needed = [min(w, window + slack) if il in swa and window > 0 else w for il, w in enumerate(wanted)]
    top = round_up(max_len, align)
    return Cells(needed, [min(round_up(n, align), top) for n in needed])


def slot_prompt_room(cells: Sequence[int], n_prompt: int, max_tokens: int, chunk: int) -> list[int]:
    """Per layer: the largest prompt capacity whose target after ``max_tokens`` plus one chunk in
    flight fits a pool slot's fixed ``cells``."""
    max_len = n_prompt + max_tokens
    return [max(1, (c - chunk - 1) * n_prompt // max_len) for c in cells]


class KVStream:
    """One request's K/V: its own context (sized by ``layer_cells``) or a slot of a shared one."""

    def __init__(self, model: Model, cfg: EngineConfig, n_ctx: int, slot: SlotSpec | None, *, full: bool,
                 whole: bool, needs_attn: bool, probe_stats: tuple[int, ...], prompt_caps: Sequence[int],
                 n_prompt: int, swa: Collection[int], window: int) -> None:
        n_layer = model.n_layer
        self.slot = slot
        self.full = full
        self.swa, self.window = swa, window
        self.seq_id = slot.seq_id if slot is not None else 0
        if slot is not None:
            self.probe = slot.probe if needs_attn else None
        else:
            self.probe = AttentionProbe(n_layer, cfg.probe_window) if needs_attn else None
        if slot is not None:
            self.ctx: Context = slot.ctx
            self.cells = list(slot.capacities)
            self.needed = self.cells
            self.flash_attn = slot.flash_attn
            self.kv_type = slot.kv_type
            return
        self.kv_type = cfg.kv_type
        self.flash_attn = flash_attn_for(cfg.kv_type, cfg.flash_attn, host_probe=needs_attn and not cfg.graph_stats)
        cfgc = context_config(n_ctx, max(cfg.chunk, cfg.probe_window), cfg.kv_type, self.flash_attn)
        if full:
            self.ctx = Context(model, cfgc)
            self.cells = [n_ctx] * n_layer
            self.needed = self.cells
            return
        # compress-after-prefill methods end the prefill with a probe_window-long chunk
        sized = layer_cells(n_layer, None if whole else prompt_caps, n_prompt, cfg.max_tokens, cfg.chunk, swa,
                            window, swa_slack=max(cfg.chunk, cfg.probe_window), align=cfg.cell_align)
        self.needed, self.cells = sized.needed, sized.cells
        self.ctx = probed_layered_context(model, self.cells, cfgc, self.probe, stats=probe_stats,
                                          in_graph=cfg.graph_stats)

    @property
    def owned(self) -> bool:
        """The stream's context is its own (not a pool's or a shared prefill's)."""
        return self.slot is None

    def held(self, il: int) -> np.ndarray:
        """Prompt/sequence positions layer il holds in this stream."""
        return np.asarray(self.ctx.positions(il, self.seq_id), dtype=np.int64)

    def held_counts(self, n_seq: int) -> list[int]:
        """Entries per layer; Full KV (upstream cache): what each layer can attend (SWA: its window)."""
        n_layer = len(self.cells)
        if self.full:
            return [full_size(il, n_seq, self.swa, self.window) for il in range(n_layer)]
        return [self.ctx.used(il, self.seq_id) for il in range(n_layer)]

    def allocated_bytes(self) -> tuple[int, int]:
        """K/V bytes of the stream, and of those the bytes the cell alignment added."""
        if self.slot is not None:
            return self.slot.kv_bytes, 0
        if self.full:
            return kv_total_bytes(self.ctx), 0
        per_layer = [sum(self.ctx.layer_bytes(il)) for il in range(len(self.cells))]
        rounding = sum(b * (self.cells[il] - self.needed[il]) // self.cells[il] for il, b in enumerate(per_layer))
        return sum(per_layer), rounding

    def close(self) -> None:
        if self.slot is None:  # a pool's context (and a shared probe) outlives its requests
            self.ctx.close()
            if self.probe is not None:
                self.probe.close()
