"""Soak: mixed traffic against a live server for a while; reports requests served, errors, RSS
growth from mid-run to the end, and leaked rows (must be 0).

Traffic per client loop, chosen at random: streaming and non-streaming completions and chat,
multi-turn sessions (create, 2-4 turns, delete), streams cut early by the client, cancellation by
request id, and bad requests (which must get their 4xx, never a 5xx).

    python -m bench.soak                       # 10 minutes, tiny random model, 8 clients
    python -m bench.soak --duration 60 --model embedded
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import socket
import threading
import time
from collections import Counter
from datetime import date
from pathlib import Path

import httpx
import uvicorn

from engine import EngineConfig
from service.app import create_app
from service.settings import Settings


def rss_bytes(pids: list[int | str] = ("self",)) -> int:
    """Resident bytes of these processes together (the front end and its engine process)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/statm") as f:
            total += int(f.read().split()[1]) * resource.getpagesize()
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    def __init__(self, url: str, rng: random.Random, vocab_hi: int) -> None:
        self.url = url
        self.rng = rng
        self.vocab_hi = vocab_hi
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.kept: list[str] = []  # sessions left open; later turns come back to them

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, self.vocab_hi) for _ in range(self.rng.randrange(3, 40))]

    def expect(self, what: str, r: httpx.Response, ok=(200,)) -> None:
        self.counts[f"{what} {r.status_code}"] += 1
        if r.status_code not in ok and r.status_code != 429:
            self.errors.append(f"{what}: {r.status_code} {r.text[:200]}")

    async def completion(self, c: httpx.AsyncClient) -> None:
        body = {"prompt": self.prompt(), "max_tokens": self.rng.randrange(1, 24), "ignore_eos": True,
                "stream": self.rng.random() < 0.6, "temperature": self.rng.choice([0, 0.7])}
        if not body["stream"]:
            self.expect("completion", await c.post(f"{self.url}/v1/completions", json=body))
            return
        cut = self.rng.random() < 0.25
        async with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            self.expect("stream", r)
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if cut and n >= 2:
                    self.counts["stream cut"] += 1
                    break
                if '"error"' in line:
                    self.errors.append(f"stream error event: {line[:200]}")

    async def session(self, c: httpx.AsyncClient) -> None:
        r = await c.post(f"{self.url}/v1/sessions")
        self.expect("session create", r)
        if r.status_code != 200:
            return
        sid = r.json()["id"]
        for _ in range(self.rng.randrange(2, 5)):
            body = {"input": self.prompt(), "max_tokens": self.rng.randrange(1, 16), "stream": False}
            self.expect("session turn", await c.post(f"{self.url}/v1/sessions/{sid}/generate", json=body))
        if self.rng.random() < 0.3:  # left open: its row ends up swapped or given up, and rebuilt later
            self.kept.append(sid)
            return
        self.expect("session delete", await c.delete(f"{self.url}/v1/sessions/{sid}"))

    async def revisit(self, c: httpx.AsyncClient) -> None:
        if not self.kept:
            return
        sid = self.rng.choice(self.kept)
        body = {"input": self.prompt(), "max_tokens": self.rng.randrange(1, 16), "stream": False}
        # 409: another client is in a turn of the same session
        self.expect("session revisit", await c.post(f"{self.url}/v1/sessions/{sid}/generate", json=body),
                    ok=(200, 409))

    async def cancel(self, c: httpx.AsyncClient) -> None:
        body = {"prompt": self.prompt(), "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            self.expect("cancel stream", r)
            if r.status_code != 200:
                return
            # cancel as soon as it is running; a fast model may have finished already (404 is right)
            rid = r.headers["x-request-id"]
            self.expect("cancel", await c.post(f"{self.url}/v1/requests/{rid}/cancel"), ok=(200, 404))
            async for line in r.aiter_lines():
                if '"error"' in line:
                    self.errors.append(f"cancelled stream error event: {line[:200]}")
        self.counts["cancelled"] += 1

    async def bad(self, c: httpx.AsyncClient) -> None:
        body = self.rng.choice([{}, {"prompt": [1], "max_tokens": -1}, {"messages": "x"}, {"prompt": [1], "top_p": 9}])
        path = self.rng.choice(["/v1/completions", "/v1/chat/completions"])
        r = await c.post(f"{self.url}{path}", json=body)
        self.expect("bad request", r, ok=(400,))

    async def client(self, deadline: float) -> None:
        actions = [self.completion] * 5 + [self.session] * 2 + [self.revisit, self.cancel, self.bad]
        async with httpx.AsyncClient(timeout=120) as c:
            while time.monotonic() < deadline:
                try:
                    await self.rng.choice(actions)(c)
                except httpx.HTTPError as e:
                    self.errors.append(f"transport: {e!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--swap-bytes", type=int, default=1 << 18, help="host memory for idle rows (about 3 rows of the tiny model)")
    ap.add_argument("--session-db", default="",
                    help="session database (default: a fresh file in a temporary directory; 'none': off)")
    a = ap.parse_args()

    import sqlite3
    import tempfile

    tmp = tempfile.TemporaryDirectory()
    db = None if a.session_db == "none" else (a.session_db or str(Path(tmp.name) / "sessions.sqlite3"))
    # a small swap budget: idle sessions' rows go to host memory first, then are given up and rebuilt
    cfg = EngineConfig(model=a.model, max_rows=a.rows, kv_cache_bytes=64 << 20, session_db=db,
                       swap_bytes=a.swap_bytes)
    settings = Settings(engine=cfg, port=free_port(), max_queued=4 * a.rows)
    app = create_app(settings)
    state = app.state.s5
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    while not state.ready:
        if state.load_error:
            raise SystemExit(state.load_error)
        time.sleep(0.1)

    soak = Soak(url, random.Random(a.seed), min(state.engine.info.vocab_size, 2000))
    procs = ["self", state.engine.pid]
    rss = {"start": rss_bytes(procs)}
    t0 = time.monotonic()

    async def run() -> None:
        deadline = t0 + a.duration

        async def mid() -> None:
            await asyncio.sleep(a.duration / 2)
            rss["mid"] = rss_bytes(procs)

        await asyncio.gather(mid(), *(soak.client(deadline) for _ in range(a.clients)))

    asyncio.run(run())
    elapsed = time.monotonic() - t0
    def on_engine(coro):
        return asyncio.run_coroutine_threadsafe(coro, state.loop).result(30)

    for _ in range(300):  # let the engine go idle
        st = on_engine(state.engine.fresh_stats())
        if not state.active and st.num_waiting == 0 and st.num_running == 0:
            break
        time.sleep(0.1)
    rss["end"] = rss_bytes(procs)
    leaked_rows = st.rows_used - st.session_rows
    on_engine(state.engine.check_invariants())
    open_sessions = st.num_sessions
    stats = st.counters
    server.should_exit = True
    thread.join(15)
    stored, db_bytes = None, None
    if db is not None:  # the file holds exactly the open sessions (deleted ones left it)
        with sqlite3.connect(db) as con:
            (stored,) = con.execute("SELECT COUNT(*) FROM sessions").fetchone()
        db_bytes = sum(p.stat().st_size for p in Path(db).parent.glob(Path(db).name + "*"))
        if stored != open_sessions:
            soak.errors.append(f"session database holds {stored} sessions, the engine {open_sessions}")

    served = sum(v for k, v in soak.counts.items() if k.endswith(" 200"))
    growth = rss["end"] - rss.get("mid", rss["end"])
    print(f"{'duration s':>12} {'clients':>8} {'served':>8} {'429':>6} {'errors':>7} {'RSS mid->end MiB':>17} "
          f"{'leaked rows':>12} {'open sessions':>14}")
    n429 = sum(v for k, v in soak.counts.items() if k.endswith(" 429"))
    print(f"{elapsed:>12.0f} {a.clients:>8} {served:>8} {n429:>6} {len(soak.errors):>7} {growth / 2**20:>17.1f} "
          f"{leaked_rows:>12} {open_sessions:>14}")
    print(f"idle session rows: {stats['swaps_out']} swapped out, {stats['swaps_in']} back; "
          f"{stats['rows_released']} given up, {stats['rebuilds']} rebuilt by replaying {stats['rebuild_forwards']} forwards")
    if db is not None:
        print(f"session database: {stored} sessions stored (= open sessions), {db_bytes / 2**20:.2f} MiB with its WAL")
    for e in soak.errors[:10]:
        print("  error:", e)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{a.model.split(':')[0]}-{date.today().isoformat()}.json"
    path.write_text(json.dumps({
        "bench": "soak", "model": a.model, "duration_s": elapsed, "clients": a.clients, "served_200": served,
        "rejected_429": n429, "errors": soak.errors, "counts": dict(soak.counts), "rss_bytes": rss,
        "rss_growth_mid_to_end_bytes": growth, "leaked_rows": leaked_rows, "open_sessions_after": open_sessions,
        "session_db": {"stored_sessions": stored, "bytes": db_bytes} if db is not None else None,
        "engine_stats": stats,
    }, indent=1))
    print(f"wrote {path}")
    if soak.errors or leaked_rows:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
