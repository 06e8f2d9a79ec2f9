"""The per-token metrics, kept without a lock on the event loop, read on /metrics exactly as
prometheus_client's own histogram and counter read for the same observations."""

import random

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from service.metrics import LATENCY, LoopCounter, LoopHistogram


def exposition(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_loop_histogram_and_counter_read_as_prometheus_clients():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = LoopHistogram("s5_x_seconds", "gaps", LATENCY)
    count = LoopCounter("s5_y", "tokens")
    ours.register(hist)
    ours.register(count)
    ref_hist = Histogram("s5_x_seconds", "gaps", buckets=LATENCY, registry=theirs)
    ref_count = Counter("s5_y", "tokens", registry=theirs)
    rng = random.Random(0)
    # on and between the bounds, beyond the last one, and zero
    values = [*LATENCY, 0.0, 500.0] + [rng.uniform(0, 150) ** 3 / 150**2 for _ in range(500)]
    for v in values:
        hist.observe(v)
        ref_hist.observe(v)
        n = rng.randrange(1, 5)
        count.inc(n)
        ref_count.inc(n)
    assert exposition(ours) == exposition(theirs)
    assert f's5_x_seconds_count {float(len(values))}' in exposition(ours)


def test_engine_stats_render_from_the_newest_snapshot():
    """The engine's published stats, rendered when /metrics is read: every gauge from the newest
    snapshot (zero before the first), every counter the engine's total, as prometheus_client's
    gauges and counters read when set and counted to the same values."""
    from engine import ipc
    from service.metrics import EngineStatsCollector, Metrics

    def snapshot(k: int) -> ipc.EngineStats:
        return ipc.EngineStats(num_waiting=k, num_running=2 * k, num_rows=64, rows_used=3 * k, session_rows=k,
                               kv_block_utilization=k / 64, num_sessions=k + 1, swapped_bytes=1000 * k,
                               counters={"swaps_out": 5 * k, "swaps_in": 4 * k, "rebuilds": 2 * k,
                                         "rebuild_forwards": 7 * k, "session_db_errors": k, "steps": 99},
                               invariant_checks=9 * k, invariant_failures=0)

    def reference(st: ipc.EngineStats | None) -> list[str]:
        reg = CollectorRegistry()
        for name, doc, field in EngineStatsCollector.GAUGES:
            Gauge(name, doc, registry=reg).set(getattr(st, field) if st else 0)
        totals = {} if st is None else {**st.counters, "invariant_checks": st.invariant_checks,
                                        "invariant_failures": st.invariant_failures}
        for name, doc, label, series in EngineStatsCollector.COUNTERS:
            c = Counter(name, doc, [label] if label else [], registry=reg)
            for value, key in series:
                (c.labels(value) if label else c).inc(totals.get(key, 0))
        return exposition(reg)

    m = Metrics()
    assert exposition(m.registry) == reference(None)
    for k in (1, 3):
        m.on_step(ipc.StepOutputs([], 0.01, snapshot(k)))
        m.on_step(ipc.StepOutputs([], 0.01, None))  # a step without stats keeps the last snapshot
        assert exposition(m.registry) == reference(snapshot(k))
    lines = exposition(m.registry)
    assert 's5_session_resumes_total{path="rebuild"} 6.0' in lines and "vllm:num_requests_running 6.0" in lines
    assert "s5_step_seconds_count 4.0" in exposition(m.own)
    assert 's5_session_evictions_total{reason="ttl"} 0.0' in exposition(m.own)  # read as 0 before any eviction
