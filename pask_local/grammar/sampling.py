"""How a request's tokens are drawn: greedy (temperature 0, the default) or sampled at a
temperature from the nucleus (``top_p``) of the grammar-allowed distribution, seeded per request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PaskError

MAX_TEMPERATURE = 2.0  # OpenAI's range


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_p: float = 1.0         # nucleus mass kept, in [0, 1] (0: the most probable token only)
    seed: int | None = None    # None: a fresh draw every request

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise PaskError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise PaskError(f"top_p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


GREEDY = Sampling()


def probabilities(logits: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """softmax(logits / temperature) over the finite logits, cut to the smallest set of most probable
    tokens whose mass reaches ``top_p`` (always at least the most probable one), renormalised."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    ok = np.isfinite(z)
    if not ok.any():
        raise PaskError("no token is allowed here")
    p = np.where(ok, np.exp(z - z[ok].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order])
        n_keep = int(np.searchsorted(mass, top_p - 1e-12)) + 1
        cut = np.zeros_like(p)
        cut[order[:n_keep]] = p[order[:n_keep]]
        p = cut / cut.sum()
    return p


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(len(p), p=p))
