"""Overload: arrivals at ten times what a real `s5serve serve` process admits. The queue stays
bounded, the excess gets 429 with Retry-After, every admitted request completes, the server's
memory stays flat across waves, and its event loop is not blocked for more than 50 ms (measured
by the server itself: /metrics s5_event_loop_lag_seconds): over four waves, after a first wave
of the same size that is not counted, at most four wake-ups that late and at most two in any one
wave; and the loop woke about as often as the waves' time allows (its timer fires every 20 ms:
at least 60% of that many wake-ups), so a loop that was not late only because it hardly ran
fails too. A loop blocked by the server's own work (a sync call, the engine step on the loop) is
late on most of a wave's wake-ups. One late wake-up in a wave is the wave itself: its 80
connections arrive together, and accepting them and running each request to its first await
(parse, validate, hand to the engine) takes about 50 ms of the loop on a two-core machine (the
front end's garbage collections, timed in s5_gc_pause_seconds, are a few milliseconds in all);
a second can be the machine: on a two-core VM the hypervisor now and then takes a core away for
tens of milliseconds (waves of 1, 2, 0 and 1 late wake-ups were seen on an otherwise idle
server).

The load comes from a separate process at lower CPU priority (`nice 10`): in production clients
are elsewhere, and on a two-core test machine a load generator at equal priority takes the
server's cores away for longer than the 50 ms being measured."""

import asyncio
import json
import os
import resource
import subprocess
import sys
import time

import httpx
import pytest

from tests.servers import metric, server_process

# latency bounds: run alone, after the tests that run in parallel (Makefile: test)
pytestmark = pytest.mark.serial

LAG_TIMER_S = 0.02  # the period of the server's event-loop lag timer (service/app.py `_loop_lag`)


def lag_counts(url: str) -> tuple[float, float]:
    """(wake-ups measured, wake-ups at most 50 ms late), from one scrape."""
    text = httpx.get(f"{url}/metrics").text
    sample = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("s5_event_loop_lag_seconds")}
    return sample["s5_event_loop_lag_seconds_count"], sample['s5_event_loop_lag_seconds_bucket{le="0.05"}']


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def wave(url: str, n: int) -> list[float | None]:
    """n requests at once; latency of each admitted one, None for each 429."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:

        async def one(i):
            t0 = time.monotonic()
            body = {"prompt": [5 + i % 50, 6, 7], "max_tokens": 24, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1"
                    await r.aread()
                    return None
                assert r.status_code == 200, r.status_code
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
                return time.monotonic() - t0

        return await asyncio.gather(*(one(i) for i in range(n)))


async def idle(url: str) -> None:
    for _ in range(300):
        if metric(url, "s5_requests_running") == 0 and metric(url, "s5_requests_queued") == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("server did not go idle")


def measure(url: str, pid: int) -> dict:
    """The load generator's side (run in its own process): waves, lag window, RSS."""
    async def run():
        # warm, not counted: a server's first burst of connections and refusals runs code paths
        # for the first time (the 429 path among them)
        await wave(url, 80)
        await idle(url)
        refused_before = metric(url, "s5_rejections_total", 'code="queue_full"')
        rss, results, lag_n, lag_over, span = [], [], 0, [], 0.0
        for _ in range(4):
            n0, ok0 = lag_counts(url)
            t0 = time.monotonic()
            results += await wave(url, 80)
            await idle(url)
            rss.append(rss_bytes(pid))
            n1, ok1 = lag_counts(url)
            span += time.monotonic() - t0
            lag_n += n1 - n0
            lag_over.append((n1 - n0) - (ok1 - ok0))
        return {"results": results, "rss": rss, "lag_n": lag_n, "lag_over": lag_over, "span": span,
                "refused_before": refused_before}
    return asyncio.run(run())


def test_ten_times_capacity(tmp_path):
    with server_process(tmp_path / "log", "--model", "tiny-random:0", "--rows", "4", "--queue-size", "8",
                        "--kv-cache-bytes", str(1 << 22)) as (proc, url):
        code = f"import json; from tests.reliability.test_overload import measure; print(json.dumps(measure({url!r}, {proc.pid})))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             preexec_fn=lambda: os.nice(10))
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        lat = sorted(r for r in res["results"] if r is not None)
        admitted, rejected = len(lat), len(res["results"]) - len(lat)
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        lag_n, lag_over, rss = res["lag_n"], res["lag_over"], res["rss"]
        timer_fires = res["span"] / LAG_TIMER_S  # wake-ups the waves' time allows
        growth = rss[-1] - rss[0]
        print(f"\n320 requests in 4 waves of 80 (queue bound 8): admitted {admitted}, 429 {rejected}; "
              f"admitted p50 {p50 * 1000:.0f} ms p99 {p99 * 1000:.0f} ms; event loop wake-ups over 50 ms late: "
              f"{lag_over} per wave of {lag_n:.0f} in all ({timer_fires:.0f} in {res['span']:.2f} s at most); "
              f"server RSS growth wave 1 -> 4 {growth / 2**20:.1f} MiB")
        assert rejected > 0 and admitted >= 4 * 8
        assert metric(url, "s5_rejections_total", 'code="queue_full"') - res["refused_before"] == rejected
        assert lag_n >= 0.6 * timer_fires and max(lag_over) <= 2 and sum(lag_over) <= 4
        assert growth < 64 * 2**20
        assert metric(url, "s5_kv_rows_used") == 0
