"""The slot pool's scheduling without a model: the step planner (``engine.step_plan``), the prefix
cache (``engine.prefix_cache``) and the queue (``engine.request_queue``), on plain data."""

from __future__ import annotations

import pytest

from pask_local.engine.prefix_cache import PrefixCache, Source, Start, common_prefix
from pask_local.engine.request_queue import PoolClosed, QueueFull, RequestQueue
from pask_local.engine.step_plan import Feed, SlotState, plan_step
from pask_local.errors import PaskError

CHUNK = 64


def prefilling(key: int, seq: int, n_prompt: int, done: int = 0, order: int | None = None, **kw) -> SlotState:
    """A request with ``done`` prompt tokens read, the rest in chunks of 64."""
    bounds = list(range(0, n_prompt, CHUNK)) + [n_prompt]
    chunks = tuple(zip(bounds[:-1], bounds[1:], strict=True))
    nxt = next(i for i, (a, _) in enumerate(chunks) if a >= done) if done < n_prompt else len(chunks)
    return SlotState(key, seq, key if order is None else order, chunks, nxt, n_prompt, **kw)


def decoding(key: int, seq: int, **kw) -> SlotState:
    return prefilling(key, seq, 100, done=100, **kw)


def fed(plan) -> list[int]:
    return [f.key for f in plan.feeds]


# ---------------------------------------------------------------- plan_step
def test_least_prompt_left_first_then_the_oldest():
    states = [prefilling(0, 0, 640), prefilling(1, 1, 100), prefilling(2, 2, 100)]
    assert fed(plan_step(states, CHUNK, prefill_tokens=64)) == [1]      # 100 left, older than 2
    assert fed(plan_step(states, CHUNK, prefill_tokens=128)) == [1, 2]
    assert fed(plan_step(states, CHUNK, prefill_tokens=0)) == [0, 1, 2]  # 0: a chunk for each
    # a request far into its prompt overtakes a fresh short one
    late = [prefilling(0, 0, 640, done=576), prefilling(1, 1, 100)]
    assert fed(plan_step(late, CHUNK, prefill_tokens=64)) == [0]


def test_the_prefill_room_bounds_prompt_tokens_but_always_takes_one_chunk():
    states = [prefilling(0, 0, 300), prefilling(1, 1, 300), prefilling(2, 2, 300)]
    plan = plan_step(states, CHUNK, prefill_tokens=100)
    assert fed(plan) == [0] and plan.prompt_tokens == 64
    assert plan_step(states, CHUNK, prefill_tokens=10).prompt_tokens == 64  # one chunk even over the room
    assert plan_step(states, CHUNK, prefill_tokens=192).prompt_tokens == 192
    # the decoding requests' tokens do not count against the room
    plan = plan_step([*states, decoding(3, 3), decoding(4, 4)], CHUNK, prefill_tokens=64)
    assert fed(plan) == [0, 3, 4] and plan.prompt_tokens == 64


def test_feeds_are_in_sequence_id_order_with_their_logits_rows():
    states = [prefilling(0, 2, 100), decoding(1, 0), prefilling(2, 1, 100, done=64)]
    plan = plan_step(states, CHUNK)
    assert [f.seq for f in plan.feeds] == [0, 1, 2]
    assert plan.feeds == (Feed(1, 0, None, True), Feed(2, 1, (64, 100), True), Feed(0, 2, (0, 64), False))


def test_a_window_reading_request_reads_its_last_chunk_alone():
    states = [decoding(0, 0), prefilling(1, 1, 192, done=128, reads_window=True), prefilling(2, 2, 300)]
    plan = plan_step(states, CHUNK)
    assert fed(plan) == [1] and plan.attention and plan.feeds[0].chunk == (128, 192)
    # before its last chunk it shares steps (and reads no statistics)
    early = plan_step([decoding(0, 0), prefilling(1, 1, 200, reads_window=True)], CHUNK)
    assert fed(early) == [0, 1] and not early.attention
    # a method reading attention every step turns the statistics on
    assert plan_step([decoding(0, 0, scores_each_decode=True)], CHUNK).attention


def test_cancelled_requests_are_released_and_take_no_room():
    states = [prefilling(0, 0, 100, cancelled=True), prefilling(1, 1, 300), decoding(2, 2, cancelled=True)]
    plan = plan_step(states, CHUNK, prefill_tokens=64)
    assert plan.release == (0, 2) and fed(plan) == [1]
    only = plan_step([decoding(0, 0, cancelled=True)], CHUNK)
    assert only.empty and only.release == (0,)


# ---------------------------------------------------------------- the prefix cache
A = list(range(1000, 1200))   # a 200-token prompt
B = A[:150] + [7] * 50       # shares 150 tokens with A


def cache(**kw) -> PrefixCache:
    return PrefixCache(**{"reuse": "any", "min_reuse": 32, "chunk": CHUNK, **kw})


def test_common_prefix():
    assert common_prefix(A, B) == 150 and common_prefix(A, A) == 200 and common_prefix([], A) == 0


def test_the_longest_held_prefix_wins():
    c = cache()
    c.hold(0, A[:100] + [1] * 20)
    c.hold(1, A[:140])
    c.hold(2, [5] * 100)
    assert c.lookup(B, [0, 1, 2]) == Start(1, 140)
    assert c.lookup(B, [0, 2]) == Start(0, 100)
    assert c.lookup(A, [1]) == Start(1, 140)
    assert c.lookup(A, [2, 3]) == Start(2, 0)  # nothing shared: the lowest free sequence, fresh


def test_exact_reuse_is_aligned_to_the_chunk_and_only_for_full_attention_readers():
    c = cache(reuse="exact")
    c.hold(0, A)
    assert c.lookup(B, [0], full=True) == Start(0, 128)    # 150 floored to the chunk
    assert c.lookup(B, [0], whole=True) == Start(0, 128)
    assert c.lookup(B, [0]) == Start(0, 0)                 # a method that evicts while it reads: fresh
    any_ = cache()
    any_.hold(0, A)
    assert any_.lookup(B, [0]) == Start(0, 150)            # "any": the whole common prefix
    c = cache(reuse="exact", holds_whole=lambda seq, n: False)  # compressed under the earlier request
    c.hold(0, A)
    assert c.lookup(B, [0], full=True) == Start(0, 0)


def test_min_reuse_and_the_last_token_is_always_decoded():
    c = cache(min_reuse=32)
    c.hold(0, A[:20])
    assert c.lookup(A, [0]) == Start(0, 0)
    c.hold(0, A)
    assert c.lookup(A, [0]) == Start(0, 199)  # the whole prompt held: its last token is decoded again
    assert cache(enabled=False).lookup(A, [0]) == Start(0, 0)
    assert not cache(enabled=False).hold(0, A)


def test_a_stream_past_the_sliding_window_is_not_reused():
    c = cache(window=512)
    c.hold(0, A + [9] * 400)                 # 600 positions: its window moved past the prefix
    assert c.lookup(A, [0]) == Start(0, 0)
    c.hold(0, A + [9] * 300)
    assert c.lookup(A, [0]) == Start(0, 199)


def source(seq: int, prompt: list[int], n_seq: int, **kw) -> Source:
    args = {"full": True, "whole": False, "last_chunk": len(prompt) // CHUNK * CHUNK, "started": True, **kw}
    return Source(seq, prompt, n_seq, **args)


def test_a_running_source_must_have_decoded_the_shared_part():
    c = cache()
    assert c.lookup(B, [1, 2], [source(0, A, n_seq=64)]) is None             # wait: 150 shared, 64 read
    assert c.lookup(B, [1, 2], [source(0, A, n_seq=0, started=False)]) is None
    assert c.lookup(B, [1, 2], [source(0, A, n_seq=192)]) == Start(1, 150, copy_from=0)
    assert c.lookup(B, [1, 2], [source(0, A, n_seq=192, cancelled=True)]) == Start(1, 0)
    # a held prefix at least as long wins over a copy
    c.hold(2, A)
    assert c.lookup(B, [1, 2], [source(0, A, n_seq=64)]) == Start(2, 150)
    # a copy goes to a free stream that holds nothing cached
    c.hold(1, [5] * 10)
    c.hold(3, [6] * 10)
    assert cache().lookup(B, [1, 3], [source(0, A, n_seq=192)]) == Start(1, 150, copy_from=0)
    c2 = cache()
    c2.hold(1, [5] * 10)
    assert c2.lookup(B, [1, 3], [source(0, A, n_seq=192)]) == Start(3, 150, copy_from=0)


def test_exact_mode_takes_a_source_only_while_it_holds_the_prefix_whole():
    c = cache(reuse="exact")
    evicting = source(0, A, n_seq=192, full=False)
    assert c.lookup(B, [1], [evicting], full=True) == Start(1, 0)
    whole_late = source(0, A, n_seq=192, full=False, whole=True, last_chunk=128)  # compresses from 128 on
    assert c.lookup(B, [1], [whole_late], whole=True) == Start(1, 0)
    whole_early = source(0, A + [3] * 100, n_seq=192, full=False, whole=True, last_chunk=256)
    assert c.lookup(B, [1], [whole_early], whole=True) == Start(1, 128, copy_from=0)
    # the sources are asked for only when a prefix may be reused
    asked = []
    c.lookup(B, [1], lambda: asked.append(1) or [])
    assert not asked
    c.lookup(B, [1], lambda: asked.append(1) or [], full=True)
    assert asked == [1]


def test_claim_takes_the_entry():
    c = cache()
    c.hold(0, A)
    start = c.lookup(B, [0])
    assert c.claim(start) == A and c.held(0) is None
    assert c.lookup(B, [0]) == Start(0, 0)
    with pytest.raises(PaskError, match="unknown prefix reuse mode"):
        PrefixCache(reuse="some")


# ---------------------------------------------------------------- the queue
def test_the_queue_bounds_running_plus_waiting():
    q: RequestQueue[str] = RequestQueue(slots=2, queue_size=1)
    for item in "abc":
        q.put(item)
    with pytest.raises(QueueFull):
        q.put("d")
    q.waiting.popleft()
    q.running = 1
    with pytest.raises(QueueFull):  # one running + two waiting = slots + queue
        q.put("d")
    q.running = 0
    q.put("d")
    assert q.close() == ["b", "c", "d"] and not q.waiting
    with pytest.raises(PoolClosed):
        q.put("e")
    unbounded: RequestQueue[int] = RequestQueue(slots=1)
    for i in range(100):
        unbounded.put(i)
