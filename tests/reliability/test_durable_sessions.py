"""Sessions outlive the process: a real `s5serve serve` is killed (SIGKILL, no shutdown) and
started again on the same session database; its sessions answer for their owners only, and a
session's next turn equals that of a session that never left the first process."""

import json
import signal
import threading
import time

import httpx

from tests.servers import metric, server_process

ARGS = ("--model", "tiny-random:0", "--rows", "4", "--window", "5", "--sink", "2",
        "--api-key", "key-a", "--api-key", "key-b")
TURNS = [([5, 6, 7, 8, 9], 9), ([40, 41], 12), ([77, 78, 79], 10)]


def turn(url, key, sid, ids, n):
    r = httpx.post(f"{url}/v1/sessions/{sid}/generate", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"input": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_sessions_resume_after_a_crash(tmp_path):
    db = str(tmp_path / "sessions.sqlite3")
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    with server_process(tmp_path / "log1", *ARGS, "--session-db", db) as (proc, url):
        left = httpx.post(f"{url}/v1/sessions", headers=a).json()["id"]
        stayed = httpx.post(f"{url}/v1/sessions", headers=a).json()["id"]
        other = httpx.post(f"{url}/v1/sessions", headers=b).json()["id"]
        for ids, n in TURNS[:2]:
            for sid, key in ((left, "key-a"), (stayed, "key-a"), (other, "key-b")):
                turn(url, key, sid, ids, n)
        want = turn(url, "key-a", stayed, *TURNS[2])  # the turn of a session that never left
        history = httpx.get(f"{url}/v1/sessions/{left}", headers=a).json()["history_tokens"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    with server_process(tmp_path / "log2", *ARGS, "--session-db", db) as (proc, url):
        info = httpx.get(f"{url}/v1/sessions/{left}", headers=a)
        assert info.status_code == 200 and info.json()["state"] == "stored"
        assert info.json()["history_tokens"] == history
        # the owner came back with the session: another tenant's key finds nothing, as before
        foreign = httpx.get(f"{url}/v1/sessions/{left}", headers=b)
        missing = httpx.get(f"{url}/v1/sessions/{'0' * 32}", headers=b)
        assert foreign.status_code == missing.status_code == 404
        assert foreign.json()["error"]["code"] == missing.json()["error"]["code"]
        assert httpx.get(f"{url}/v1/sessions/{other}", headers=b).status_code == 200
        got = turn(url, "key-a", left, *TURNS[2])
        resume = httpx.get(f"{url}/v1/sessions/{left}", headers=a).json()["last_resume"]
        rebuilds = metric(url, "s5_session_resumes_total", 'path="rebuild"', headers=a)
        print(f"\nafter SIGKILL and restart: 3 sessions back, next turn {'equal' if got == want else 'DIFFERENT'} "
              f"to a session that never left; resumed by {resume}")
        assert got == want and resume["path"] == "rebuild" and resume["tokens"] == history
        assert rebuilds == 1


def test_a_drained_server_keeps_every_completed_turn(tmp_path):
    """SIGTERM with session turns streaming: they finish within the grace period, and after a
    restart each session holds exactly what its stream delivered."""
    db = str(tmp_path / "sessions.sqlite3")
    a = {"Authorization": "Bearer key-a"}
    with server_process(tmp_path / "log1", *ARGS, "--rows", "16", "--session-db", db) as (proc, url):
        sids = [httpx.post(f"{url}/v1/sessions", headers=a).json()["id"] for _ in range(12)]
        got, started = {}, []

        def stream(sid, i):
            body = {"input": [5 + i, 6, 7], "max_tokens": 150, "temperature": 0, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/sessions/{sid}/generate", json=body, headers=a, timeout=60) as r:
                out = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        if not out:
                            started.append(sid)
                        out += ev.get("token_ids", []) if ev["type"] == "token" else []
                got[sid] = out

        threads = [threading.Thread(target=stream, args=(sid, i)) for i, sid in enumerate(sids)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(set(started)) < len(sids) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0

    with server_process(tmp_path / "log2", *ARGS, "--session-db", db) as (proc, url):
        kept = [httpx.get(f"{url}/v1/sessions/{sid}", headers=a).json()["history_tokens"] for sid in sids]
        print(f"\ndrained with {len(sids)} session turns streaming: {sum(len(v) == 150 for v in got.values())} "
              f"finished; after the restart {sum(k == 3 + 150 for k in kept)} sessions hold their turn")
        assert all(len(got[sid]) == 150 for sid in sids) and kept == [3 + 150] * len(sids)
