"""Teacher forcing through the engine: a ``Decoder`` that feeds given tokens and scores every step.

``ForcedDecoder`` wraps ``chat.decoder.Decoder`` and is handed to ``Engine`` as its
``decoder_factory``, so a method runs its normal path (same prompt, prefill, eviction, budget
growth) while the tokens it decodes are fixed in advance (Full KV's output, or a gold call). At
each step ``choose`` records, from the raw logits (float64 log-softmax): the method's own choice
(the grammar-constrained greedy token it would have emitted), the log-probability of the forced
token and, given a reference step (Full KV's distribution there), KL(reference || method); it
returns the forced token. ``accept`` tags the token through the inner decoder's grammar tagger.
Without forced tokens it records greedy decoding itself (``keep_top``: each step's top-K, which is
what a reference stores).

A reference step keeps Full KV's ``TOP_K`` most likely tokens plus the log of the mass of all the
others; the KL is computed over those K+1 outcomes (the other tokens pooled into one). That is a
lower bound on the full-vocabulary KL, equal to it up to the pooled mass (typically far below 1%).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..chat.decoder import Decoder
from ..chat.protocol import Plan
from ..classes import StructuralClass
from ..errors import NativeError
from ..grammar.sampler import SamplerStats
from ..llm import Model

TOP_K = 128


@dataclass
class RefStep:
    """A reference distribution at one step: top-K token ids, their log-probs, log of the rest's mass."""

    ids: np.ndarray     # int64 [K]
    lp: np.ndarray      # float64 [K]
    rest: float         # log of the probability of every token not in ``ids`` (-inf: none)


@dataclass
class StepStat:
    """What one forced step measured."""

    token: int                       # the token fed (forced) at this step
    own: int                         # the method's own constrained greedy choice
    lp: float                        # log-probability of ``token`` under the method (raw logits)
    kl: float | None                 # KL(reference || method) at this step; None without a reference
    cls: StructuralClass | None = None  # the token's class; None for an end-of-generation token


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def logsumexp(x: np.ndarray) -> float:
    if x.size == 0:
        return -np.inf
    m = float(np.max(x))
    if not np.isfinite(m):
        return m
    return m + float(np.log(np.sum(np.exp(x - m))))


def _rest(lp: np.ndarray, ids: np.ndarray) -> float:
    """log of the total probability of the tokens not in ``ids`` (summed directly: no cancellation)."""
    mask = np.ones(lp.shape[0], dtype=bool)
    mask[ids] = False
    return logsumexp(lp[mask])


def top_k_step(lp: np.ndarray, k: int = TOP_K) -> RefStep:
    """The reference form of a log-softmax vector ``lp``."""
    k = min(k, lp.shape[0])
    ids = np.argpartition(-lp, k - 1)[:k]
    ids = ids[np.lexsort((ids, -lp[ids]))].astype(np.int64)
    return RefStep(ids=ids, lp=lp[ids].astype(np.float64), rest=_rest(lp, ids))


def coarse_kl(ref: RefStep, lp: np.ndarray) -> float:
    """KL(ref || lp) over ref's top-K tokens and one pooled outcome for all others (nats, >= 0)."""
    p = np.exp(ref.lp)
    kl = float(np.sum(p * (ref.lp - lp[ref.ids])))
    if np.isfinite(ref.rest):
        kl += float(np.exp(ref.rest)) * (ref.rest - _rest(lp, ref.ids))
    return max(0.0, kl)


class ForcedDecoder:
    """A ``Decoder`` stand-in that emits ``forced`` (None: its own greedy choice) and scores each step."""

    def __init__(self, model: Model, plan: Plan, forced: Sequence[int] | None = None,
                 ref: Sequence[RefStep] | None = None, keep_top: int = 0) -> None:
        self.inner = Decoder(model, plan)
        self.forced = list(forced) if forced is not None else None
        self.ref = ref
        self.keep_top = keep_top
        self.steps: list[StepStat] = []
        self.tops: list[RefStep] = []   # with keep_top: this run's own distribution per step
        self.failed: str | None = None  # the grammar rejected a forced token (then generation stops)
        self._done = False

    @property
    def stats(self) -> SamplerStats:
        return self.inner.stats

    @property
    def done(self) -> bool:
        return self._done or self.inner.done

    @property
    def rejected(self) -> bool:
        return self.inner.rejected or self.failed is not None

    def choose(self, logits: np.ndarray, temperature: float = 0.0) -> int:
        i = len(self.steps)
        own = self.inner.choose(logits)
        tok = own if self.forced is None else self.forced[i]
        lp = log_softmax(logits)
        kl = coarse_kl(self.ref[i], lp) if self.ref is not None and i < len(self.ref) else None
        self.steps.append(StepStat(token=tok, own=own, lp=float(lp[tok]), kl=kl))
        if self.keep_top:
            self.tops.append(top_k_step(lp, self.keep_top))
        return tok

    def accept(self, token: int) -> StructuralClass:
        try:
            cls = self.inner.accept(token)
        except NativeError:
            self.failed = f"the grammar rejects forced token {len(self.steps) - 1}"
            self._done = True
            cls = StructuralClass.GEN_STRUCT
        self.steps[-1].cls = cls
        if self.forced is not None and len(self.steps) >= len(self.forced):
            self._done = True
        return cls

    def close(self) -> None:
        self.inner.close()
