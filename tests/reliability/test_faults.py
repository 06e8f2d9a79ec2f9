"""Poison and faults: a failure inside one request's step ends that request only; a failure of
the engine process (killed) turns /health to 503 at once and makes the server exit non-zero, and no
engine process outlives its server."""

import json
import math
import os
import signal
import threading
import time

import httpx
import pytest

from engine import Engine, EngineConfig, FinishReason, Request, SamplingParams
from service.settings import Settings
from tests.servers import LiveServer, alive, free_port, server_process
from tests.helpers import greedy, tiny_loaded

# latency bounds: run alone, after the tests that run in parallel (Makefile: test)
pytestmark = pytest.mark.serial


def requests(sampled_poison: bool):
    reqs = [Request(f"r{i}", [2] + [(13 * i + 7 * t) % 500 + 3 for t in range(9 + 5 * i)], greedy(12))
            for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True) if sampled_poison else greedy(12)
    reqs.append(Request("poison", [2, 40, 41, 42, 43], params))
    return reqs


def drive(engine, reqs):
    out = {r.request_id: [] for r in reqs}
    ends = {}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                ends[o.request_id] = (o.finish_reason, o.error)
    return out, ends


@pytest.mark.parametrize("fault", ["nan-greedy", "nan-sampled", "inf-greedy", "hook-raises"])
def test_poisoned_request_fails_alone(fault):
    loaded = tiny_loaded(0)
    cfg = EngineConfig(model="tiny-random", max_rows=8, max_num_batched_tokens=24)
    sampled = fault == "nan-sampled"
    clean, _ = drive(Engine(cfg, loaded), requests(sampled))

    engine = Engine(cfg, loaded)
    seen = {"n": 0}

    def inject(rid, pos, logits):
        if rid != "poison":
            return
        seen["n"] += 1
        if seen["n"] == 3:  # its third sampled token
            if fault == "hook-raises":
                raise RuntimeError("injected")
            logits.fill_(math.inf if fault == "inf-greedy" else math.nan)

    engine.logits_hook = inject
    out, ends = drive(engine, requests(sampled))
    engine.check_invariants()
    reason, error = ends["poison"]
    print(f"\n{fault}: poison ended {reason.value} ({error}); others {sum(out[r] == clean[r] for r in clean if r != 'poison')}/6 unchanged")
    assert reason == FinishReason.ERROR and error
    assert len(out["poison"]) == 2
    for rid in clean:
        if rid != "poison":
            assert ends[rid][0] == FinishReason.LENGTH and out[rid] == clean[rid], rid
    assert engine.pool.used_rows() == []
    # the engine keeps serving
    engine.logits_hook = None
    again, _ = drive(engine, [Request("after", [2, 9, 9, 9], greedy(5))])
    assert len(again["after"]) == 5


def test_poisoned_turn_rolls_the_session_back():
    loaded = tiny_loaded(1)
    engine = Engine(EngineConfig(model="tiny-random", max_rows=4), loaded)
    sid = engine.create_session()
    drive(engine, [Request("t1", [2, 5, 6, 7], greedy(4), session_id=sid)])
    before = engine.session_tokens(sid)

    def boom(rid, pos, logits):
        if rid == "t2":
            logits.fill_(math.nan)

    engine.logits_hook = boom
    _, ends = drive(engine, [Request("t2", [8, 9], greedy(4), session_id=sid)])
    assert ends["t2"][0] == FinishReason.ERROR
    assert engine.session_tokens(sid) == before
    engine.logits_hook = None
    out, _ = drive(engine, [Request("t3", [8, 9], greedy(4), session_id=sid)])
    ref = Engine(EngineConfig(model="tiny-random", max_rows=4), loaded)
    sid2 = ref.create_session()
    drive(ref, [Request("t1", [2, 5, 6, 7], greedy(4), session_id=sid2)])
    expect, _ = drive(ref, [Request("t3", [8, 9], greedy(4), session_id=sid2)])
    assert out["t3"] == expect["t3"]
    engine.check_invariants()


@pytest.mark.parametrize("route", ["completions", "session"])
def test_killed_engine_turns_health_503_and_requests_exit(route):
    """The streams in flight end with the in-band error event, then [DONE], on the OpenAI routes
    and on a session's turn alike, and the SDK's parser raises it."""
    from service.client import GenerationFailed, parse_sse

    settings = Settings(engine=EngineConfig(model="tiny-random", max_rows=2, kv_cache_bytes=1 << 22), port=free_port())
    srv = LiveServer(settings).start()
    exits = []
    srv.state.on_fatal = lambda: exits.append(time.monotonic())
    try:
        events = []

        if route == "session":
            sid = httpx.post(f"{srv.url}/v1/sessions").json()["id"]
            path, body = f"/v1/sessions/{sid}/generate", {"input": [5, 6, 7]}
        else:
            path, body = "/v1/completions", {"prompt": [5, 6, 7]}
        lines = []

        def stream():
            with httpx.stream("POST", f"{srv.url}{path}", json={**body, "max_tokens": 3000, "stream": True,
                                                               "ignore_eos": True}, timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        events.append(line[6:])

        assert httpx.get(f"{srv.url}/health").status_code == 200
        t = threading.Thread(target=stream)
        t.start()
        while not events:  # it is streaming (a tokenizer-less model sends its first chunk, then the last)
            assert t.is_alive()
            time.sleep(0.01)
        os.kill(srv.state.engine.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(f"{srv.url}/health").status_code != 503:
            assert time.monotonic() - t0 < 1, "health still green 1 s after the engine died"
            time.sleep(0.01)
        took = time.monotonic() - t0
        t.join(10)
        assert not t.is_alive()
        errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and "engine" in errors[-1]["error"]["message"] and events[-1] == "[DONE]"
        assert errors[-1]["error"]["code"] == "generation_failed" and not any('"done"' in e for e in events)
        with pytest.raises(GenerationFailed):
            list(parse_sse(lines))
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"\nhealth 503 after {took:.2f} s; exit requested after {exits[0] - t0:.2f} s" if exits else "")
        assert exits, "the server did not ask to exit after the engine died"
        assert srv.state.fatal and "exited" in srv.state.fatal
    finally:
        srv.stop()


def _engine_pid(server_pid: int) -> int:
    children = open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()
    assert len(children) == 1, children
    return int(children[0])


def test_serve_exits_nonzero_when_its_engine_is_killed(tmp_path):
    with server_process(tmp_path / "log", "--model", "tiny-random") as (proc, url):
        engine = _engine_pid(proc.pid)
        os.kill(engine, signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() - t0 < 1
            time.sleep(0.01)
        assert proc.wait(30) != 0
        assert not alive(engine)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_engine_outlives_the_server(tmp_path, sig):
    with server_process(tmp_path / "log", "--model", "tiny-random") as (proc, url):
        engine = _engine_pid(proc.pid)
        os.kill(proc.pid, sig)
        proc.wait(30)
        deadline = time.monotonic() + 5
        while alive(engine):
            assert time.monotonic() < deadline, f"the engine process outlived its server ({sig.name})"
            time.sleep(0.05)
        if sig == signal.SIGTERM:
            assert proc.returncode == 0  # drained and stopped its engine
