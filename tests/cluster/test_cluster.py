"""`s5serve cluster` for real: Ray Serve with two engine replicas behind the gateway, sessions in
a real PostgreSQL, the tiny random model. Compared token for token with one `s5serve serve`
(memory-only sessions) fed the same turns.

Replicas are killed as a failure kills them (ray.kill: the replica's process and, with it, its
engine process and its connection to the store)."""

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest
import ray
from ray import serve

from service.cluster import (APP_NAME, ENGINE_DEPLOYMENT, REPLICA_HEADER, engine_replicas, parse_cluster_args,
                             runtime_env, start, stop)
from service.settings import parse_serve_args
from tests.servers import LiveServer, free_port

ENGINE = ["--model", "tiny-random:0", "--quantization", "none", "--rows", "24", "--kv-cache-bytes", "16M",
          "--max-num-batched-tokens", "64"]
MAX_TOKENS = 8


@dataclass
class Cluster:
    url: str
    db: str


@pytest.fixture(scope="module")
def cluster(postgres):
    db = postgres.database()
    port = free_port()
    settings = parse_cluster_args([*ENGINE, "--session-db", db, "--port", str(port), "--replicas", "2",
                                   "--replica-cpus", "0"])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), log_to_driver=False)
    try:
        start(settings)
        yield Cluster(f"http://127.0.0.1:{port}", db)
    finally:
        stop()


def live_server(*args: str) -> LiveServer:
    return LiveServer(parse_serve_args([*ENGINE, "--port", str(free_port()), *args])).start()


@pytest.fixture(scope="module")
def reference():
    """One `s5serve serve`, sessions in memory: what every turn must equal."""
    server = live_server("--session-db", "none")
    yield server
    server.stop()


def plan(seed: int, sessions: int, turns: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] for _ in range(turns)]
            for _ in range(sessions)]


async def create(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/sessions")
    assert r.status_code == 200, r.text
    return r.json()["id"]


async def turn(client: httpx.AsyncClient, sid: str, ids: list[int], max_tokens: int = MAX_TOKENS,
               retry_failed_replica: bool = False) -> tuple[list[int], str]:
    """A non-streamed turn: (tokens generated, the replica that served it)."""
    body = {"input": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": False}
    for _ in range(40):
        r = await client.post(f"/v1/sessions/{sid}/generate", json=body)
        if retry_failed_replica and r.status_code == 503 and r.json()["error"]["code"] == "replica_failed":
            await asyncio.sleep(0.5)  # the router has not seen the replica go yet
            continue
        break
    assert r.status_code == 200, r.text
    assert r.json()["finish_reason"] == "length"
    return r.json()["token_ids"], r.headers.get(REPLICA_HEADER, "")


async def rounds(url: str, turns: list[list[list[int]]], sids: list[str] | None = None,
                 which: range | None = None, **kw) -> tuple[list[str], list[list[list[int]]], list[list[str]]]:
    """Every session's turns, round by round, the sessions of a round concurrently."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        sids = sids or [await create(client) for _ in turns]
        out: list[list[list[int]]] = [[] for _ in sids]
        served: list[list[str]] = [[] for _ in sids]
        for r in which or range(len(turns[0])):
            results = await asyncio.gather(*(turn(client, sid, t[r], **kw) for sid, t in zip(sids, turns)))
            for i, (tokens, replica) in enumerate(results):
                out[i].append(tokens)
                served[i].append(replica)
    return sids, out, served


def session(url: str, sid: str) -> dict:
    r = httpx.get(f"{url}/v1/sessions/{sid}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def kill_replica(unique_id: str) -> None:
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#{unique_id}", namespace="serve")
    ray.kill(actor, no_restart=True)


def wait_for_leases_released(db: str, timeout: float = 60) -> float:
    """Until the store holds no session lease (advisory lock): a dead replica's go with its
    connection, once PostgreSQL has seen that connection close. Returns the seconds it took."""
    import psycopg

    t0 = time.monotonic()
    with psycopg.connect(db, autocommit=True) as conn:
        while time.monotonic() - t0 < timeout:
            (held,) = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                                   "database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                                   ).fetchone()
            if held == 0:
                return time.monotonic() - t0
            time.sleep(0.1)
    raise AssertionError(f"a dead replica's session lease was still held after {timeout} s")


def wait_for_replicas(killed: str, n: int = 2, timeout: float = 180) -> None:
    """Until Ray Serve has replaced the killed replica: n replicas running, the killed one not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT].replica_states
        actors = engine_replicas()
        if states == {"RUNNING": n} and len(actors) == n and killed not in actors:
            return
        time.sleep(0.5)
    raise AssertionError(f"the cluster did not get back to {n} replicas: {states}, {actors}")


def test_each_session_stays_on_one_replica_and_matches_one_server(cluster, reference):
    turns = plan(1, sessions=16, turns=4)
    sids, got, served = asyncio.run(rounds(cluster.url, turns))
    _, want, _ = asyncio.run(rounds(reference.url, turns))
    assert got == want
    assert all(len(set(s)) == 1 and s[0] for s in served), served  # one replica per session
    assert len({s[0] for s in served}) == 2  # and both replicas serve sessions
    for sid, s in zip(sids, served):
        info = session(cluster.url, sid)
        assert info["turns"] == 4 and info["state"] == "resident" and info["last_resume"] is None
        assert info["history_tokens"] == sum(len(t) for t in turns[sids.index(sid)]) + 4 * MAX_TOKENS

    # the replicas' load under vLLM's names too
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith(("vllm:", "s5_requests_", "s5_kv_block_utilization"))}
    assert gauges["vllm:num_requests_running"] == gauges["s5_requests_running"]
    assert gauges["vllm:num_requests_waiting"] == gauges["s5_requests_queued"]
    assert 0 < gauges["vllm:kv_cache_usage_perc"] == gauges["s5_kv_block_utilization"] <= 1

    # bad input: the OpenAI error envelope, through the gateway, and nothing changes
    r = httpx.post(f"{cluster.url}/v1/sessions/{sids[0]}/generate", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(f"{cluster.url}/v1/sessions/{sids[0]}/generate", json={"input": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{cluster.url}/v1/sessions/{'0' * 32}/generate", json={"input": [5], "max_tokens": 1}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = httpx.post(f"{cluster.url}/v1/completions", content=b"x" * (5 << 20), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert session(cluster.url, sids[0])["turns"] == 4


def test_sessions_of_a_killed_replica_continue_exactly_on_another(cluster, reference):
    turns = plan(2, sessions=16, turns=3)
    sids, got, served = asyncio.run(rounds(cluster.url, turns, which=range(2)))
    by_replica: dict[str, list[int]] = {}
    for i, s in enumerate(served):
        by_replica.setdefault(s[0], []).append(i)
    killed, victims = max(by_replica.items(), key=lambda kv: len(kv[1]))
    assert len(victims) >= 8
    kill_replica(killed)
    _, third, served3 = asyncio.run(rounds(cluster.url, turns, sids=sids, which=range(2, 3),
                                           retry_failed_replica=True))
    _, want, _ = asyncio.run(rounds(reference.url, turns))
    assert [g + t for g, t in zip(got, third)] == want  # every session, token for token
    for i in victims:
        assert served3[i][0] not in ("", killed)
        info = session(cluster.url, sids[i])
        assert info["turns"] == 3 and info["last_resume"]["path"] == "rebuild"
    wait_for_replicas(killed)


def test_a_turn_on_a_replica_that_dies_ends_with_an_error_and_is_not_committed(cluster, reference):
    turns = plan(3, sessions=1, turns=3)
    (sid,), _, _ = asyncio.run(rounds(cluster.url, turns, which=range(2)))
    before = session(cluster.url, sid)
    events, replica = [], None
    body = {"input": [7, 8, 9], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/sessions/{sid}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        replica = r.headers[REPLICA_HEADER]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 1:
                kill_replica(replica)
    assert events[-1] == "[DONE]" and len(events) < 3000
    last = json.loads(events[-2])
    assert last["error"]["code"] == "replica_failed", events[-3:]
    assert not any(e.startswith('{"type":"done"') for e in events)
    print(f"\nthe dead replica's lease went {wait_for_leases_released(cluster.db):.2f} s after its stream ended")
    # the session is at its last completed turn, and its next turn succeeds on another replica
    after = session(cluster.url, sid)
    assert before["turns"] == after["turns"] == 2 and after["history_tokens"] == before["history_tokens"]
    _, third, served = asyncio.run(rounds(cluster.url, turns, sids=[sid], which=range(2, 3), retry_failed_replica=True))
    _, want, _ = asyncio.run(rounds(reference.url, turns))
    assert third[0][0] == want[0][2] and served[0][0] != replica
    wait_for_replicas(replica)


def test_racing_turns_of_one_session_on_two_replicas_one_gets_409(cluster):
    """A second replica of the same store, reached directly: while a turn of the session runs on
    the cluster's replica, a turn sent to the other one is refused (the lease), and the session
    goes on there once the first turn committed."""
    other = live_server("--session-db", cluster.db)
    try:
        (sid,), _, _ = asyncio.run(rounds(cluster.url, plan(4, sessions=1, turns=1)))
        statuses = []
        body = {"input": [7, 8, 9], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{cluster.url}/v1/sessions/{sid}/generate", json=body, timeout=120) as r:
            statuses.append(r.status_code)
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {")).startswith('data: {"type":"token"')
            raced = httpx.post(f"{other.url}/v1/sessions/{sid}/generate",
                               json={"input": [5], "max_tokens": 4, "stream": False}, timeout=60)
            statuses.append(raced.status_code)
            assert raced.json()["error"]["code"] == "session_busy"
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(rest[-2][6:])["finish_reason"] == "length"
        assert statuses.count(409) == 1 and statuses.count(200) == 1
        assert session(other.url, sid)["turns"] == 2  # the winner's turn, committed, is what the other sees
        r = httpx.post(f"{other.url}/v1/sessions/{sid}/generate",
                       json={"input": [5], "max_tokens": 4, "stream": False}, timeout=60)
        assert r.status_code == 200 and session(cluster.url, sid)["turns"] == 3
    finally:
        other.stop()


def test_a_turn_is_cancelled_by_its_request_id_or_when_its_client_goes_away(cluster):
    (sid,), _, _ = asyncio.run(rounds(cluster.url, plan(5, sessions=1, turns=1)))
    body = {"input": [7, 8, 9], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/sessions/{sid}/generate", json=body, timeout=120) as r:
        (request_id,) = r.headers.get_list("x-request-id")  # one id, the one a cancel takes
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert next(lines).startswith('data: {"type":"token"')
        cancelled = httpx.post(f"{cluster.url}/v1/requests/{request_id}/cancel", timeout=30)
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["finish_reason"] == "abort"
    assert session(cluster.url, sid)["turns"] == 1  # rolled back
    r = httpx.post(f"{cluster.url}/v1/requests/{request_id}/cancel", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"

    with httpx.stream("POST", f"{cluster.url}/v1/sessions/{sid}/generate", json=body, timeout=120) as r:
        next(line for line in r.iter_lines() if line.startswith('data: {"type":"token"'))
    # the client went away: the replica aborts the turn and the session is idle again, unchanged
    deadline = time.monotonic() + 30
    while (info := session(cluster.url, sid))["state"] == "busy" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert info["state"] != "busy" and info["turns"] == 1


# Last in this module: it leaves the gateway draining (the fixture then stops the cluster).
def test_a_drain_refuses_new_requests_lets_streams_finish_and_ends_the_rest_at_its_grace(cluster):
    """What SIGTERM or Ctrl-C starts in `s5serve cluster`: the gateway answers new requests 503
    `draining`; a stream that ends within the grace runs to its last event; one still running at
    the grace's end is ended by its replica (finish reason "abort"); every stream ends with
    [DONE], and then the cluster stops."""
    import threading

    from service.cluster import drain

    grace = 3.0
    settings = parse_cluster_args([*ENGINE, "--session-db", "none", "--replicas", "1", "--drain-grace", str(grace)])
    events: dict[str, list[str]] = {"short": [], "long": []}
    started = {name: threading.Event() for name in events}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[name].append(line)
                    started[name].set()

    streams = [threading.Thread(target=stream, args=("short", 40)), threading.Thread(target=stream, args=("long", 4000))]
    for t in streams:
        t.start()
    assert all(e.wait(60) for e in started.values())
    drained, t0 = {}, time.monotonic()
    thread = threading.Thread(target=lambda: drained.setdefault("ok", drain(settings)))
    thread.start()
    deadline = time.monotonic() + 30
    while True:  # the gateway refuses new work once the drain has reached it
        refused = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=30)
        if refused.status_code == 503:
            break
        assert time.monotonic() < deadline, refused.text
        time.sleep(0.1)
    assert refused.json()["error"]["code"] == "draining" and refused.headers["retry-after"]
    thread.join(60)
    for t in streams:
        t.join(60)
    assert drained == {"ok": False} and time.monotonic() - t0 >= grace  # the long stream outlived the grace
    for name, finish in (("short", "length"), ("long", "abort")):
        assert events[name][-1] == "data: [DONE]", events[name][-3:]
        assert json.loads(events[name][-2][6:])["choices"][0]["finish_reason"] == finish, events[name][-2]
