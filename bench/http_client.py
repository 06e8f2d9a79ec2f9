"""What the benchmark's HTTP client adds to a burst's TTFT: one client process sends --n
concurrent POSTs of a --prompt-len-id completion body (as `bench.serve` sends them) to a trivial
ASGI app under uvicorn in another process, which answers each with the time it got the whole body.
Per client it reports, over --rounds bursts, when the requests reached the app after their sends
(p50 and the last, each the median over the bursts), against httpx with a connection per request
measured in the same run (the client `bench.serve` used before it moved to aiohttp).

    python -m bench.http_client --n 32 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from datetime import date
from pathlib import Path

import aiohttp
import httpx

from bench.serve import _open_connections, client_session, free_port


async def _app(scope, receive, send) -> None:
    """Reads the whole body, answers with the monotonic time it had it."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    got = time.monotonic()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": repr(got).encode()})


def _serve(port: int) -> None:
    import uvicorn

    uvicorn.run(_app, host="127.0.0.1", port=port, log_level="warning")


async def _burst_aiohttp(url: str, body: dict, n: int, warm: bool) -> list[float]:
    async with client_session(url, n) as client:
        if warm:
            await _open_connections(client, n)

        async def one() -> float:
            sent = time.monotonic()
            async with client.post("/x", json=body) as r:
                return float(await r.text()) - sent

        return await asyncio.gather(*(one() for _ in range(n)))


async def _burst_httpx(url: str, body: dict, n: int) -> list[float]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def one() -> float:
            sent = time.monotonic()
            r = await client.post("/x", json=body)
            return float(r.text) - sent

        return await asyncio.gather(*(one() for _ in range(n)))


CLIENTS = {
    "httpx, a connection per request": lambda url, body, n: _burst_httpx(url, body, n),
    "aiohttp, a connection per request": lambda url, body, n: _burst_aiohttp(url, body, n, False),
    "aiohttp, warm connections": lambda url, body, n: _burst_aiohttp(url, body, n, True),
}
BASELINE = "httpx, a connection per request"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="requests per burst (bench.serve: streams per client process)")
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(url + "/")
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    body = {"prompt": list(range(1000, 1000 + a.prompt_len)), "max_tokens": 512, "stream": True}
    delays: dict[str, list[list[float]]] = {name: [] for name in CLIENTS}
    try:
        for _ in range(a.rounds):  # the clients alternate, so a drift of the machine's speed hits each alike
            for name, burst in CLIENTS.items():
                delays[name].append(sorted(asyncio.run(burst(url, body, a.n))))
    finally:
        server.terminate()
        server.join()
    rows = []
    for name, rounds in delays.items():
        p50 = sorted(r[len(r) // 2] for r in rounds)[len(rounds) // 2]
        worst = sorted(r[-1] for r in rounds)[len(rounds) // 2]
        rows.append({"client": name, "p50_ms": p50 * 1e3, "max_ms": worst * 1e3,
                     "rounds_p50_ms": [r[len(r) // 2] * 1e3 for r in rounds]})
    base = next(r for r in rows if r["client"] == BASELINE)
    print(f"{a.n} requests of {a.prompt_len} ids at once from one process; arrival after send, median of "
          f"{a.rounds} bursts")
    print(f"{'client':36s} {'p50 ms':>8s} {'max ms':>8s} {'p50 / httpx':>12s}")
    for r in rows:
        r["p50_over_baseline"] = r["p50_ms"] / base["p50_ms"]
        print(f"{r['client']:36s} {r['p50_ms']:8.1f} {r['max_ms']:8.1f} {r['p50_over_baseline']:12.2f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"http-client-{date.today().isoformat()}{'-' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps({"bench": "http_client", "n": a.n, "prompt_len": a.prompt_len, "rounds": a.rounds,
                                "versions": {"aiohttp": aiohttp.__version__, "httpx": httpx.__version__},
                                "baseline": BASELINE, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
