"""What the next ``llama_decode`` of the slot pool holds: a pure function of plain per-request state.

``plan_step`` reads one ``SlotState`` per running request and returns a ``StepPlan`` (frozen data,
as vLLM's scheduler output): which requests feed which prompt chunk or their next token, in
sequence-id order (upstream splits a multi-stream batch into ubatches of consecutive sequences), and
which cancelled requests to release. ``engine.pool`` executes the plan; the rules live here only:

- prefilling requests with the least prompt left go first, then the oldest, so a request that starts
  from a reused prefix is not held behind a long prefill for the room of many steps;
- one step carries at most ``prefill_tokens`` prompt tokens (at least one chunk; 0: a chunk for every
  prefilling request) besides one token of every decoding request;
- a request whose method reads the observation window of its prompt's last chunk gets that chunk
  in a step of its own: upstream splits a batch into ubatches of equal tokens per sequence, and the
  window statistic counts the last queries of each ubatch, so the chunk must be one ubatch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotState:
    """One running request as the planner sees it."""

    key: int                          # the request's identity in the pool
    seq: int                          # its sequence id (KV stream)
    order: int                        # admission order (lower: older)
    chunks: tuple[tuple[int, int], ...]  # its prompt chunks [a, b)
    next_chunk: int                   # the next chunk to decode (== len(chunks): decoding)
    n_prompt: int
    reads_window: bool = False        # its method reads the window of its prompt's last chunk
    scores_each_decode: bool = False  # its method reads attention after every decode (H2O, TOVA)
    cancelled: bool = False

    @property
    def prefilling(self) -> bool:
        return self.next_chunk < len(self.chunks)

    @property
    def prompt_left(self) -> int:
        return self.n_prompt - self.chunks[self.next_chunk][0]

    @property
    def reads_window_now(self) -> bool:
        """Its next chunk is its prompt's last and its method reads that chunk's window."""
        return self.reads_window and self.next_chunk == len(self.chunks) - 1


@dataclass(frozen=True)
class Feed:
    """What one request puts into the step: a prompt chunk [start, end) or (``chunk`` None) its next token."""

    key: int
    seq: int
    chunk: tuple[int, int] | None
    logits: bool                      # its last token's logits are read (a decode, or the prompt's last chunk)


@dataclass(frozen=True)
class StepPlan:
    feeds: tuple[Feed, ...]           # in sequence-id order
    release: tuple[int, ...] = ()     # cancelled requests to release before the step
    attention: bool = False           # a fed request reads the probe's statistics from this step
    prompt_tokens: int = 0            # prompt tokens the step carries

    @property
    def empty(self) -> bool:
        return not self.feeds


def plan_step(states: list[SlotState], chunk: int, prefill_tokens: int = 0) -> StepPlan:
    """The next step for ``states`` (module doc); ``prefill_tokens`` 0: a chunk per prefilling request."""
    release = tuple(s.key for s in sorted(states, key=lambda s: s.seq) if s.cancelled)
    live = [s for s in states if not s.cancelled]
    prefilling = sorted((s for s in live if s.prefilling), key=lambda s: (s.prompt_left, s.order))
    solo = next((s for s in prefilling if s.reads_window_now), None)
    room = prefill_tokens or len(prefilling) * chunk
    fed: set[int] = set()
    for s in prefilling if solo is None else [solo]:
        a, b = s.chunks[s.next_chunk]
        if fed and b - a > room:  # the first always fits: a step carries at least one chunk
            break
        fed.add(s.key)
        room -= b - a
    feeds: list[Feed] = []
    for s in sorted(live, key=lambda s: s.seq):
        if solo is not None and s is not solo:
            continue
        if s.prefilling:
            if s.key not in fed:  # waits for a later step's prefill room
                continue
            feeds.append(Feed(s.key, s.seq, s.chunks[s.next_chunk], s.next_chunk == len(s.chunks) - 1))
        else:
            feeds.append(Feed(s.key, s.seq, None, True))
    by_key = {s.key: s for s in live}
    attention = any(by_key[f.key].scores_each_decode or by_key[f.key].reads_window_now for f in feeds)
    prompt = sum(f.chunk[1] - f.chunk[0] for f in feeds if f.chunk is not None)
    return StepPlan(tuple(feeds), release, attention, prompt)
