"""Prometheus metrics of one server (a registry of its own, so several servers in a process do not collide)."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; TTFT includes the time a request waited in the queue.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
RATE_WINDOW_S = 10.0  # prefill / decode tok/s are averaged over the steps of this many recent seconds
MAX_WINDOW_STEPS = 4096


class ServerMetrics:
    """Counters, gauges and histograms of one server; ``snapshot`` is a callable returning the loop's
    ``{"running", "waiting", "cache_used_blocks", "cache_blocks"}``."""

    def __init__(self, snapshot) -> None:
        self.registry = r = CollectorRegistry()
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._steps: collections.deque = collections.deque(maxlen=MAX_WINDOW_STEPS)  # (time, decode, prefill, s)
        Gauge("deepinfer_num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: self._snapshot()["running"])
        Gauge("deepinfer_num_requests_waiting", "Requests queued for the running batch", registry=r).set_function(
            lambda: self._snapshot()["waiting"])
        Gauge("deepinfer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1)", registry=r).set_function(
            lambda: self._snapshot()["cache_used_blocks"] / max(1, self._snapshot()["cache_blocks"]))
        Gauge("deepinfer_kv_cache_used_blocks", "KV-cache blocks in use", registry=r).set_function(
            lambda: self._snapshot()["cache_used_blocks"])
        Gauge("deepinfer_prefill_tokens_per_second", f"Prefill tokens per second over the last {RATE_WINDOW_S:g} s",
              registry=r).set_function(lambda: self._rate(2))
        Gauge("deepinfer_decode_tokens_per_second", f"Decode tokens per second over the last {RATE_WINDOW_S:g} s",
              registry=r).set_function(lambda: self._rate(1))
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Output tokens of finished requests",
                                         registry=r)
        self.prefix_queries = Counter("deepinfer_prefix_cache_queries", "Prompt tokens of finished requests "
                                      "looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("deepinfer_prefix_cache_hits", "Prompt tokens of finished requests served from "
                                   "the prefix cache (not computed)", registry=r)
        self._prefix = [0, 0]  # (hits, queries) for the rate
        Gauge("deepinfer_prefix_cache_hit_rate", "Fraction of the prompt tokens of finished requests served from "
              "the prefix cache (0..1)", registry=r).set_function(lambda: self._prefix[0] / max(1, self._prefix[1]))
        self.requests = Counter("deepinfer_requests", "Requests that ended, by outcome (finished, error, aborted)", ["outcome"], registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Time to first token (queueing included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)

    def observe_steps(self, records) -> None:
        now = time.monotonic()
        with self._lock:
            for rec in records:
                self._steps.append((now, rec.decode_tokens, rec.prefill_tokens, rec.seconds))

    def _rate(self, which: int) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        with self._lock:
            recent = [s for s in self._steps if s[0] >= cutoff]
        seconds = sum(s[3] * s[which] / max(1, s[1] + s[2]) for s in recent)
        return sum(s[which] for s in recent) / seconds if seconds > 0 else 0.0

    def observe_request(self, seq) -> None:
        self.requests.labels("finished").inc()
        self.prompt_tokens.inc(seq.num_prompt_tokens)
        self.prefix_queries.inc(seq.num_prompt_tokens)
        self.prefix_hits.inc(seq.num_cached_tokens)
        with self._lock:
            self._prefix[0] += seq.num_cached_tokens
            self._prefix[1] += seq.num_prompt_tokens
        self.generation_tokens.inc(seq.num_output_tokens)
        if seq.first_token_time is not None:
            self.ttft.observe(max(0.0, seq.first_token_time - seq.arrival_time))
            if seq.num_output_tokens > 1 and seq.finish_time is not None:
                self.tpot.observe(max(0.0, (seq.finish_time - seq.first_token_time) / (seq.num_output_tokens - 1)))

    def observe_error(self, error: dict) -> None:
        self.requests.labels("aborted" if error.get("code") == "client_disconnected" else "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
