"""`s5serve serve --api-servers 2`: two HTTP front-end processes on one port, one engine process.
Whichever front end takes a connection, a request's tokens are the engine's, admission limits,
sessions and cancels hold across front ends, /metrics counts both, and the whole tree starts,
drains and dies as one server."""

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from engine import EngineConfig
from tests.servers import alive, engine_alone, metric, server_process, stream_ids

TINY = EngineConfig(model="tiny-random:3", max_rows=8, kv_cache_bytes=1 << 22, max_num_batched_tokens=64)
FLAGS = ("--model", "tiny-random:3", "--rows", "8", "--kv-cache-bytes", "4M", "--max-num-batched-tokens", "64",
         "--quantization", "none", "--session-db", "none", "--api-servers", "2")
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
STREAM_KEYS = [f"key-{i}" for i in range(12)]  # one per concurrent stream: within the per-key limit

# latency bounds: run alone, after the tests that run in parallel (Makefile: test)
pytestmark = pytest.mark.serial


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _cmdline(pid: int) -> str:
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()


def _all_ready(url: str, timeout: float = 120) -> None:
    """/ready on fresh connections (spread over the front ends) answers 200 ten times in a row."""
    deadline, ok = time.monotonic() + timeout, 0
    while ok < 10:
        assert time.monotonic() < deadline, "the front ends never all became ready"
        ok = ok + 1 if httpx.get(f"{url}/ready").status_code == 200 else 0
        time.sleep(0.02 if ok else 0.2)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    log = tmp_path_factory.mktemp("api-servers") / "log"
    keys = ",".join(["key-a", "key-b", *STREAM_KEYS])
    with server_process(log, *FLAGS, "--api-keys", keys, "--max-requests-per-key", "2") as (proc, url):
        _all_ready(url)
        yield proc, url, log


def _front_ends_in_log(log, path: str) -> set[str]:
    return set(re.findall(r"\[front end (\d+)\]: .*" + re.escape(path), open(log).read()))


async def _stream(url: str, key: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        return await stream_ids(client, prompt, max_tokens)


def test_streams_through_two_front_ends_equal_the_engine_in_process(two):
    proc, url, log = two
    prompts = [[2] + [(31 * i + 7 * t) % 500 + 3 for t in range(5 + 11 * i)] for i in range(12)]
    lengths = [20 + 3 * i for i in range(12)]
    alone = engine_alone(TINY, prompts, lengths)  # the same model (seeded), in this process

    async def run():
        # each on a connection of its own
        return await asyncio.gather(*(_stream(url, k, p, n) for k, p, n in zip(STREAM_KEYS, prompts, lengths)))

    served = asyncio.run(run())
    assert served == alone
    assert _front_ends_in_log(log, '"POST /v1/completions') == {"0", "1"}  # both took streams


def test_limits_sessions_and_cancels_hold_across_front_ends(two):
    proc, url, log = two
    # two long streams of key-a: its limit (2) is reached, whichever front end the next one reaches
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "ignore_eos": True}
    ids, ends = [], []

    def hold():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=A, timeout=60) as r:
            ids.append(r.headers["x-request-id"])
            last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
            ends.append(json.loads(last[6:])["choices"][0]["finish_reason"])

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    while len(ids) < 2:
        time.sleep(0.01)
    small = {"prompt": [5], "max_tokens": 2}
    refused = [httpx.post(f"{url}/v1/completions", json=small, headers=A) for _ in range(8)]
    assert [r.status_code for r in refused] == [429] * 8
    assert {r.json()["error"]["code"] for r in refused} == {"too_many_requests"}
    assert httpx.post(f"{url}/v1/completions", json=small, headers=B).status_code == 200  # another key
    # cancels, each on a connection of its own: the engine finds the request wherever it runs
    for rid in ids:
        assert httpx.post(f"{url}/v1/requests/{rid}/cancel", headers=B).status_code == 404  # not theirs
        assert httpx.post(f"{url}/v1/requests/{rid}/cancel", headers=A).json()["cancelled"] is True
    for t in holders:
        t.join(30)
    assert ends == ["abort", "abort"]  # ended by the cancel, not by length or a stop
    assert httpx.post(f"{url}/v1/completions", json=small, headers=A).status_code == 200  # the slots are back

    # a session's turns, each through whichever front end takes its connection
    sid = httpx.post(f"{url}/v1/sessions", headers=A).json()["id"]
    history = []
    for turn in range(4):
        r = httpx.post(f"{url}/v1/sessions/{sid}/generate", headers=A,
                       json={"input": [7 + turn, 8], "max_tokens": 3, "temperature": 0, "stream": False})
        assert r.status_code == 200, r.text
        history += [7 + turn, 8] + r.json()["token_ids"]
        info = httpx.get(f"{url}/v1/sessions/{sid}", headers=A).json()
        assert info["history_tokens"] == len(history) and info["turns"] == turn + 1
    assert httpx.get(f"{url}/v1/sessions/{sid}", headers=B).status_code == 404
    assert httpx.delete(f"{url}/v1/sessions/{sid}", headers=A).json()["deleted"] is True
    assert _front_ends_in_log(log, f"/v1/sessions/{sid}") == {"0", "1"}


def test_metrics_count_every_front_end(two):
    proc, url, log = two
    finished = 'finish_reason="length"'
    time.sleep(1.5)  # each front end publishes its counts about once a second: earlier tests' are in
    before = metric(url, "s5_requests_finished_total", finished, A)
    tokens = metric(url, "s5_generation_tokens_total", headers=A)
    for i in range(10):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, i + 3], "max_tokens": 4, "ignore_eos": True},
                       headers=A)
        assert r.status_code == 200
    deadline = time.monotonic() + 10
    while metric(url, "s5_requests_finished_total", finished, A) != before + 10:
        assert time.monotonic() < deadline, "/metrics never counted both front ends' requests"
        time.sleep(0.2)
    for _ in range(5):  # whichever front end answers, the sums are the same
        assert metric(url, "s5_requests_finished_total", finished, A) == before + 10
        assert metric(url, "s5_generation_tokens_total", headers=A) == tokens + 40

    # counters never go back from one scrape to the next, whichever front end answers each
    seen = [0.0]
    for i in range(30):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [6, i + 3], "max_tokens": 2}, headers=A)
        assert r.status_code == 200
        seen.append(metric(url, "s5_prompt_tokens_total", headers=A))
        assert seen[-1] >= seen[-2], seen


def test_a_killed_engine_takes_the_whole_server_down(tmp_path):
    with server_process(tmp_path / "log", *FLAGS) as (proc, url):
        _all_ready(url)
        kids = _children(proc.pid)
        (engine,) = [k for k in kids if "engine.process" in _cmdline(k)]
        os.kill(engine, signal.SIGKILL)
        t0 = time.monotonic()
        answers = []
        while len(answers) < 6:  # fresh connections: each front end answers some
            answers.append(httpx.get(f"{url}/health").status_code)
            if answers[-1] != 503:
                answers.clear()
                assert time.monotonic() - t0 < 1, "a front end still answered /health 200 after 1 s"
        assert proc.wait(30) != 0
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids):
            assert time.monotonic() < deadline, "a process of the server outlived it"
            time.sleep(0.05)


@pytest.mark.parametrize("sig,group", [(signal.SIGTERM, False), (signal.SIGKILL, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGKILL", "Ctrl-C"])
def test_the_server_drains_and_no_process_outlives_it(tmp_path, sig, group):
    """SIGTERM drains; SIGKILL leaves no process behind; Ctrl-C (SIGINT to the whole process
    group, every process of the server included) drains as SIGTERM does, without a traceback."""
    with server_process(tmp_path / "log", *FLAGS, new_group=group) as (proc, url):
        _all_ready(url)
        kids = _children(proc.pid)
        assert len(kids) == 3  # the engine and two front ends
        kids += [g for k in kids for g in _children(k)]  # the front ends' tokenizer processes
        got: list[int] = []
        started = threading.Event()

        def stream():
            body = {"prompt": [5, 6], "max_tokens": 150, "stream": True, "ignore_eos": True, "return_token_ids": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            got.extend(json.loads(line[6:])["choices"][0]["token_ids"])
                            started.set()
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        code = proc.wait(60)
        t.join(30)
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids):
            assert time.monotonic() < deadline, f"a process of the server outlived it ({sig.name})"
            time.sleep(0.05)
        if sig != signal.SIGKILL:
            assert code == 0 and len(got) == 150  # the stream in flight finished first
            assert "Traceback" not in (tmp_path / "log").read_text()
