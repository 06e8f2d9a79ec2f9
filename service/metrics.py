"""Prometheus metrics, on registries owned by the app (no process globals).

Two kinds: what the engine's published stats say (`Metrics.registry`: load, KV use, sessions,
swaps; the same in every front end), and what this front end measured itself (`Metrics.own`:
latencies, tokens, requests, its event loop). With several front-end processes each writes its
own measurements to a shared directory (`SharedMetrics`) about once a second, and /metrics, on
whichever front end answers it, adds the others' to its own: counters and histograms summed,
gauges (maxima) by their largest value.
"""

from __future__ import annotations

import gc
import os
import time
from bisect import bisect_left

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class LoopHistogram:
    """A histogram for the per-token metrics, which every stream updates at every engine step:
    plain counts, touched by the event loop alone (no lock per observation, unlike
    prometheus_client's), exposed in the same form when /metrics is rendered on the loop."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> list[HistogramMetricFamily]:
        total, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        return [HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)]


class LoopCounter:
    """A counter updated by the event loop alone (see LoopHistogram)."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, value=self.value)]


class EngineStatsCollector:
    """The engine's newest published stats (ipc.EngineStats) as metric families, built when
    /metrics is rendered: taking a snapshot is one assignment on the event loop."""

    GAUGES = (  # name, help, the snapshot's field
        ("s5_requests_queued", "Requests waiting for admission", "num_waiting"),
        ("s5_requests_running", "Requests holding a row and running", "num_running"),
        ("s5_kv_block_utilization", "Share of paged KV blocks in use", "kv_block_utilization"),
        ("s5_kv_rows_used", "KV rows in use (sessions and requests)", "rows_used"),
        ("s5_sessions", "Open sessions", "num_sessions"),
        ("s5_swapped_kv_bytes", "Host bytes of swapped session rows", "swapped_bytes"),
        # The same load under vLLM's names, which Kubernetes inference gateways (Gateway API
        # inference extension, llm-d) read to pick a replica. kv_cache_usage_perc is a share
        # (0..1), as vLLM reports it.
        ("vllm:num_requests_waiting", "Requests waiting for admission", "num_waiting"),
        ("vllm:num_requests_running", "Requests running", "num_running"),
        ("vllm:kv_cache_usage_perc", "Share of paged KV blocks in use (0..1)", "kv_block_utilization"),
    )
    COUNTERS = (  # name, help, label, [(label value, the engine's counter)]
        ("s5_session_swaps", "Session rows moved to host memory (out) and back (in)", "direction",
         [("out", "swaps_out"), ("in", "swaps_in")]),
        ("s5_session_resumes", "Session rows brought back for a turn: swap-in (from host memory, no "
         "recompute) or rebuild (replaying the transcript's forwards)", "path",
         [("swap-in", "swaps_in"), ("rebuild", "rebuilds")]),
        ("s5_session_rebuild_forwards", "Forwards replayed to rebuild rows", None, [(None, "rebuild_forwards")]),
        ("s5_session_store_errors", "Failed reads or writes of the session database (a session whose "
         "write failed continues in memory only)", None, [(None, "session_db_errors")]),
        ("s5_invariant_checks", "Engine invariant checks run while idle", None, [(None, "invariant_checks")]),
        ("s5_invariant_failures", "Engine invariant checks that failed (the engine process logs each)", None,
         [(None, "invariant_failures")]),
    )

    def __init__(self) -> None:
        self.stats = None  # the newest ipc.EngineStats; None until the engine publishes one

    def collect(self) -> list[Metric]:
        st = self.stats
        out: list[Metric] = []
        for name, doc, field in self.GAUGES:
            out.append(GaugeMetricFamily(name, doc, value=getattr(st, field) if st is not None else 0))
        totals = {} if st is None else {**st.counters, "invariant_checks": st.invariant_checks,
                                        "invariant_failures": st.invariant_failures}
        for name, doc, label, series in self.COUNTERS:
            family = CounterMetricFamily(name, doc, labels=[label] if label else None)
            for value, key in series:
                family.add_metric([value] if label else [], totals.get(key, 0))
            out.append(family)
        return out


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()  # from the engine's stats
        own = self.own = CollectorRegistry()  # this front end's measurements
        self.engine_stats = EngineStatsCollector()
        r.register(self.engine_stats)
        self.ttft = Histogram("s5_time_to_first_token_seconds", "Time to first token", buckets=LATENCY, registry=own)
        self.itl = LoopHistogram("s5_inter_token_latency_seconds", "Time between tokens", LATENCY)
        own.register(self.itl)
        self.e2e = Histogram("s5_request_latency_seconds", "End-to-end request latency", buckets=LATENCY, registry=own)
        self.step = LoopHistogram("s5_step_seconds", "Engine step time", LATENCY)
        own.register(self.step)
        self.prompt_tokens = Counter("s5_prompt_tokens", "Prompt tokens received", registry=own)
        self.prefill_tokens = Counter("s5_prefill_tokens", "Tokens prefilled (computed)", registry=own)
        self.cached_tokens = Counter("s5_cached_tokens", "Prompt tokens reused from session rows", registry=own)
        self.generation_tokens = LoopCounter("s5_generation_tokens", "Tokens generated")
        own.register(self.generation_tokens)
        self.finished = Counter("s5_requests_finished", "Finished requests", ["finish_reason"], registry=own)
        self.rejections = Counter("s5_rejections", "Requests answered with an error, by its code (500s and the "
                                  "probes aside)", ["code"], registry=own)
        self.evictions = Counter("s5_session_evictions", "Sessions evicted", ["reason"], registry=own)
        self.evictions.labels("ttl")  # the one reason: its sample reads 0 before the first eviction
        self.loop_lag = LoopHistogram("s5_event_loop_lag_seconds", "How late the event loop woke a 20 ms timer",
                                      (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        own.register(self.loop_lag)
        self.loop_lag_max = Gauge("s5_event_loop_lag_max_seconds", "Worst event loop lag seen", registry=own)
        self._lag_max = 0.0
        self.gc_pause = Histogram("s5_gc_pause_seconds", "Front-end garbage collections (they stop the event loop)",
                                  ["generation"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1), registry=own)
        self._gc_pause_by_generation = [self.gc_pause.labels(str(g)) for g in range(3)]
        self._gc_started = 0.0

    def on_step(self, msg) -> None:
        """An engine message (ipc.StepOutputs), on the event loop: its step time, and the engine's
        stats snapshot when it carries one."""
        if msg.step_seconds > 0:
            self.step.observe(msg.step_seconds)
        if msg.stats is not None:
            self.engine_stats.stats = msg.stats

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)
        if seconds > self._lag_max:
            self._lag_max = seconds
            self.loop_lag_max.set(seconds)

    def watch_gc(self, on: bool) -> None:
        """Time this process's garbage collections into `gc_pause` (on), or stop (off)."""
        if on and self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        elif not on and self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self._gc_pause_by_generation[info["generation"]].observe(time.perf_counter() - self._gc_started)

    def render(self, others: list[list] = ()) -> bytes:
        """The exposition: the engine's stats, and this front end's measurements plus `others`
        (other front ends' `snapshot()`s)."""
        own = self.own if not others else _Merged([self.snapshot(), *others])
        return generate_latest(self.registry) + generate_latest(own)

    def snapshot(self) -> list:
        """This front end's measurements as plain data: [name, type, help, [[sample, labels,
        value], ...]] per family."""
        return [[f.name, f.type, f.documentation, [[x.name, x.labels, x.value] for x in f.samples]]
                for f in self.own.collect()]


class _Merged:
    """A collector of several front ends' snapshots, added up."""

    def __init__(self, snapshots: list[list]) -> None:
        self.snapshots = snapshots

    def collect(self) -> list[Metric]:
        families: dict[str, tuple[Metric, dict]] = {}
        for snap in self.snapshots:
            for name, kind, doc, samples in snap:
                if name not in families:
                    families[name] = (Metric(name, doc, kind), {})
                values = families[name][1]
                for sample, labels, value in samples:
                    key = (sample, tuple(sorted(labels.items())))
                    if key not in values:
                        values[key] = value
                    elif kind == "gauge":  # the front end's only gauge is a maximum
                        values[key] = max(values[key], value)
                    elif sample.endswith("_created"):
                        values[key] = min(values[key], value)
                    else:
                        values[key] += value
        out = []
        for metric, values in families.values():
            for (sample, labels), value in values.items():
                metric.add_sample(sample, dict(labels), value)
            out.append(metric)
        return out


class SharedMetrics:
    """Several front ends' measurements, through files in one directory (`<index>.json`, each
    replaced whole): `publish` this front end's, `others` to read the rest."""

    def __init__(self, directory: str, index: int) -> None:
        self.directory, self.index = directory, index
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder(list).decode

    def publish(self, metrics: Metrics) -> None:
        path = os.path.join(self.directory, f"{self.index}.json")
        with open(path + ".tmp", "wb") as f:
            f.write(self._encode(metrics.snapshot()))
        os.replace(path + ".tmp", path)

    def others(self) -> list[list]:
        snaps = []
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".json") or name == f"{self.index}.json":
                continue
            try:
                with open(os.path.join(self.directory, name), "rb") as f:
                    snaps.append(self._decode(f.read()))
            except (OSError, msgspec.DecodeError):  # gone meanwhile, or not ours
                continue
        return snaps
