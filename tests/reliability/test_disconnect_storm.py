"""Disconnect storm: 500 session turns streamed by 100 concurrent sessions against a live server,
30% of them cut by the client at random moments (queued, prefilling, decoding). Afterwards: no row
or block leaked, every session holds exactly its completed turns, and every completed turn's tokens
equal those of an undisturbed replay of the completed turns alone."""

import asyncio
import json
import random

import httpx
import pytest

from engine import EngineConfig
from service.settings import Settings
from tests.servers import LiveServer, free_port

SESSIONS, TURNS, CUT_SHARE = 100, 5, 0.3


@pytest.fixture(scope="module")
def storm_server():
    settings = Settings(engine=EngineConfig(model="tiny-random", max_rows=SESSIONS + 8, kv_cache_bytes=1 << 24,
                                            max_num_batched_tokens=256),
                        port=free_port(), max_queued=4 * SESSIONS, session_ttl_s=3600)
    srv = LiveServer(settings)
    yield srv.start()
    srv.stop()


async def turn(client, sid, ids, max_tokens, cut_after_s):
    """Streams one turn; returns its token ids, or None when the client cut it. The cut timer starts
    once the server has answered 200: the turn is then in the engine (queued, prefilling or
    decoding). A cut before that leaves the client no way to know whether the server will still
    receive the request, so a following turn could race it."""
    async def read(r):
        out = []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                assert ev.get("type") != "error" and "error" not in ev, ev
                out += ev.get("token_ids", []) if ev["type"] == "token" else []
        return out

    while True:
        async with client.stream("POST", f"/v1/sessions/{sid}/generate",
                                 json={"input": ids, "max_tokens": max_tokens, "temperature": 0,
                                       "ignore_eos": True}) as r:
            if r.status_code == 409:  # the previous (cut) turn is still being aborted
                await asyncio.sleep(0.02)
                continue
            assert r.status_code == 200, await r.aread()
            if cut_after_s is None:
                return await read(r)
            try:
                return await asyncio.wait_for(read(r), cut_after_s)
            except asyncio.TimeoutError:
                return None  # leaving the block closes the connection mid-stream


async def session_run(client, server, plan):
    """One session's turns in order; returns [(input, output or None if cut)], with cut turns that
    completed on the server anyway (the cut came after the last token) read back from its history."""
    sid = (await client.post("/v1/sessions")).json()["id"]
    done, hist = [], 0
    for ids, max_tokens, cut in plan:
        out = await turn(client, sid, ids, max_tokens, cut)
        if out is None:  # cut: wait until the server has let go of the turn, then look at the history
            while (await client.get(f"/v1/sessions/{sid}")).json()["state"] == "busy":
                await asyncio.sleep(0.01)
            tokens = await asyncio.to_thread(server.engine, "session_tokens", sid)
            out = tokens[hist + len(ids):] if len(tokens) > hist else None
        if out is not None:
            hist += len(ids) + len(out)
        done.append((ids, max_tokens, out))
    tokens = await asyncio.to_thread(server.engine, "session_tokens", sid)
    return sid, done, tokens


def test_500_streams_30_percent_cut(storm_server):
    srv = storm_server
    rng = random.Random(500)
    def one_turn():
        ids = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
        if rng.random() < CUT_SHARE:  # long enough to still be running when the client cuts it
            return ids, rng.randrange(400, 800), rng.uniform(0.0, 0.4)
        return ids, rng.randrange(1, 24), None

    plans = [[one_turn() for _ in range(TURNS)] for _ in range(SESSIONS)]

    async def storm(plans):
        limits = httpx.Limits(max_connections=SESSIONS + 10)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(session_run(client, srv, p) for p in plans))

    disturbed = asyncio.run(storm(plans))
    srv.wait_idle()
    cut = sum(c is not None for p in plans for _, _, c in p)
    cut_effective = sum(out is None for _, done, _ in disturbed for _, _, out in done)
    # every session holds exactly its completed turns (a cut turn rolled back)
    for sid, done, tokens in disturbed:
        assert tokens == [t for ids, _, out in done if out is not None for t in ids + out], sid
    # an undisturbed replay of only the completed turns gives the same tokens, turn by turn
    replay_plans = [[(ids, n, None) for ids, n, out in done if out is not None] for _, done, _ in disturbed]
    undisturbed = asyncio.run(storm(replay_plans))
    mismatches = sum(a != b for (_, d, _), (_, u, _) in zip(disturbed, undisturbed)
                     for a, b in zip([out for _, _, out in d if out is not None], [out for _, _, out in u]))
    srv.check_invariants()
    stats = srv.stats()
    leaked_rows = stats.rows_used - stats.session_rows
    print(f"\n{SESSIONS * TURNS} streams, {cut} cut by the client ({cut_effective} before the turn completed), "
          f"{mismatches} completed turns differing from the undisturbed replay, {leaked_rows} leaked rows")
    assert mismatches == 0 and leaked_rows == 0
    assert cut_effective >= 0.2 * SESSIONS * TURNS  # the cuts really interrupted turns
    assert srv.metric("s5_requests_running") == 0 and srv.metric("s5_requests_queued") == 0
