"""Prometheus metrics, on a registry owned by the app (no process globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queued = Gauge("s5_requests_queued", "Requests waiting for admission", registry=r)
        self.running = Gauge("s5_requests_running", "Requests holding a row and running", registry=r)
        self.kv_utilization = Gauge("s5_kv_block_utilization", "Share of paged KV blocks in use", registry=r)
        self.rows_used = Gauge("s5_kv_rows_used", "KV rows in use (sessions and requests)", registry=r)
        self.sessions = Gauge("s5_sessions", "Open sessions", registry=r)
        self.ttft = Histogram("s5_time_to_first_token_seconds", "Time to first token", buckets=LATENCY, registry=r)
        self.itl = Histogram("s5_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY, registry=r)
        self.e2e = Histogram("s5_request_latency_seconds", "End-to-end request latency", buckets=LATENCY, registry=r)
        self.step = Histogram("s5_step_seconds", "Engine step time", buckets=LATENCY, registry=r)
        self.prompt_tokens = Counter("s5_prompt_tokens", "Prompt tokens received", registry=r)
        self.prefill_tokens = Counter("s5_prefill_tokens", "Tokens prefilled (computed)", registry=r)
        self.cached_tokens = Counter("s5_cached_tokens", "Prompt tokens reused from session rows", registry=r)
        self.generation_tokens = Counter("s5_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("s5_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.rejections = Counter("s5_rejections", "Requests refused", ["code"], registry=r)
        self.evictions = Counter("s5_session_evictions", "Sessions evicted", ["reason"], registry=r)
        self.swaps = Counter("s5_session_swaps", "Session rows moved to host memory (out) and back (in)",
                             ["direction"], registry=r)
        self.resumes = Counter("s5_session_resumes", "Session rows brought back for a turn: swap-in (from host "
                               "memory, no recompute) or rebuild (replaying the transcript's forwards)",
                               ["path"], registry=r)
        self.rebuild_forwards = Counter("s5_session_rebuild_forwards", "Forwards replayed to rebuild rows", registry=r)
        self.store_errors = Counter("s5_session_store_errors", "Failed reads or writes of the session database "
                                    "(a session whose write failed continues in memory only)", registry=r)
        self.swapped_bytes = Gauge("s5_swapped_kv_bytes", "Host bytes of swapped session rows", registry=r)
        self.loop_lag = Histogram("s5_event_loop_lag_seconds", "How late the event loop woke a 20 ms timer",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1), registry=r)
        self.loop_lag_max = Gauge("s5_event_loop_lag_max_seconds", "Worst event loop lag seen", registry=r)
        self._lag_max = 0.0
        self._seen = {"swaps_out": 0, "swaps_in": 0, "rebuilds": 0, "rebuild_forwards": 0, "session_db_errors": 0}

    def on_step(self, engine, outputs, seconds: float) -> None:
        """Called on the engine thread after every step."""
        self.step.observe(seconds)
        pool = engine.pool
        self.queued.set(engine.num_waiting)
        self.running.set(engine.num_running)
        self.rows_used.set(pool.num_rows - pool.num_free_rows)
        if pool.paged_layers:
            self.kv_utilization.set(1 - pool.num_free_blocks / (pool.num_blocks - 1))
        self.sessions.set(len(engine.sessions))
        counters = {"swaps_out": self.swaps.labels("out"), "swaps_in": self.swaps.labels("in"),
                    "rebuilds": self.resumes.labels("rebuild"), "rebuild_forwards": self.rebuild_forwards,
                    "session_db_errors": self.store_errors}
        for key, counter in counters.items():
            n = engine.stats[key]
            if n > self._seen[key]:
                counter.inc(n - self._seen[key])
                if key == "swaps_in":
                    self.resumes.labels("swap-in").inc(n - self._seen[key])
                self._seen[key] = n
        self.swapped_bytes.set(engine.swapped_bytes)

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)
        if seconds > self._lag_max:
            self._lag_max = seconds
            self.loop_lag_max.set(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
