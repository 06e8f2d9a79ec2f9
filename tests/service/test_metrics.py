"""The per-token metrics, kept without a lock on the event loop, read on /metrics exactly as
prometheus_client's own histogram and counter read for the same observations."""

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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
