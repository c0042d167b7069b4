"""Prometheus metrics of one server (``GET /metrics``, text exposition format).

Requests by HTTP status and by how they finished, prompt and completion tokens, time to first
token and time per output token (histograms, seconds; TTFT counts from the request's arrival, so
it includes the time spent queued), KV entries the method held at the end of each request next to
what full KV would have held, the pool's state (slots busy, requests waiting) and, with batching,
the pool's memory and step loop (tokens per llama_decode, the host's share of a step). Each server
has its own registry, so several apps can live in one process (the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no *_created series: they only add noise to a scrape

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class Metrics:
    """The server's counters, histograms and gauges."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, busy: Callable[[], int], waiting: Callable[[], int], slots: int, queue_size: int,
                 pool: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pask_requests", "Chat-completion requests answered, by HTTP status.",
                                ["status"], registry=r)
        self.finished = Counter("pask_requests_finished", "Requests that ran on a slot, by how they ended "
                                "(tool_calls, stop, length, cancelled, error).", ["reason"], registry=r)
        self.prompt_tokens = Counter("pask_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.completion_tokens = Counter("pask_completion_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("pask_time_to_first_token_seconds", "From the request's arrival (queueing "
                              "included) to its first generated token.", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pask_time_per_output_token_seconds", "Mean time per generated token after the "
                              "first, per request.", buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("pask_request_duration_seconds", "From arrival to the last token.",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.kv_held = Counter("pask_kv_entries_held", "KV entries (all layers) held at the end of each request, "
                               "summed over requests.", registry=r)
        self.kv_full = Counter("pask_kv_entries_full", "KV entries full KV would have held at the end of each "
                               "request, summed over requests.", registry=r)
        self.kv_held_last = Gauge("pask_kv_entries_held_last", "KV entries held at the end of the last request.",
                                  registry=r)
        self.kv_full_last = Gauge("pask_kv_entries_full_last", "KV entries full KV would have held at the end of "
                                  "the last request.", registry=r)
        Gauge("pask_slots_busy", "Slots running a request now.", registry=r).set_function(busy)
        Gauge("pask_queue_waiting", "Requests admitted and waiting for a slot.", registry=r).set_function(waiting)
        Gauge("pask_slots", "Slots (requests run at once).", registry=r).set(slots)
        Gauge("pask_queue_capacity", "Requests that may wait for a slot before new ones get 429.",
              registry=r).set(queue_size)
        if pool is not None:  # the batched pool (engine.pool.SlotPool)
            Gauge("pask_kv_pool_bytes", "K/V bytes of the slot pool (fixed at start-up).",
                  registry=r).set(pool.kv_bytes)
            Gauge("pask_kv_slot_bytes", "K/V bytes of one slot.", registry=r).set(pool.slot_bytes)
            Gauge("pask_batch_steps", "llama_decode calls of the step loop.",
                  registry=r).set_function(lambda: pool.steps)
            Gauge("pask_batch_tokens_per_step", "Mean tokens per llama_decode call.",
                  registry=r).set_function(lambda: pool.stats()["tokens_per_step"])
            Gauge("pask_batch_host_share", "Share of the step loop's time outside llama_decode (sampling, "
                  "grammar, tagging, eviction).", registry=r).set_function(lambda: pool.stats()["host_share"])
            Gauge("pask_prefix_reused_tokens", "Prompt tokens not prefilled: their K/V came from a finished "
                  "request's stream (the prefix cache) or was copied from a running request's.",
                  registry=r).set_function(lambda: pool.reused_tokens)
            Gauge("pask_prefix_shared_tokens", "Of those, prompt tokens copied from a running request's stream.",
                  registry=r).set_function(lambda: pool.shared_tokens)

    def request(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def finish(self, reason: str, stats: dict[str, Any] | None, ttft: float | None, tpot: float | None,
               duration: float) -> None:
        """A request that ran on a slot has ended (``stats``: the engine's, None if it failed)."""
        self.finished.labels(reason=reason).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.duration.observe(duration)
        if stats is None:
            return
        self.prompt_tokens.inc(stats["n_prompt"])
        self.completion_tokens.inc(stats["n_gen"])
        held, full = sum(stats["held_per_group"]), sum(stats["full_per_group"])
        self.kv_held.inc(held)
        self.kv_full.inc(full)
        self.kv_held_last.set(held)
        self.kv_full_last.set(full)

    def render(self) -> bytes:
        return generate_latest(self.registry)
