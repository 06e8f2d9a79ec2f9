"""SIGTERM on a real `s5serve serve` process: readiness turns 503, new work gets 503, streams
in flight finish, and the process exits 0."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import free_port


@pytest.mark.parametrize("grace,max_tokens,finish", [(30, 400, "length"), (1, 4000, "stop")])
def test_sigterm_drains_streams(tmp_path, grace, max_tokens, finish):
    """Streams that finish within the grace period end normally; the rest end with a final
    event when it runs out. Either way every stream ends with [DONE]."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", "tiny-random:0", "--port", str(port),
         "--drain-grace", str(grace), "--rows", "8", "--kv-cache-bytes", str(1 << 24)],
        env=env, stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("server never became ready: " + (tmp_path / "log").read_text())
        results = {}

        def stream(i):
            body = {"prompt": [5, 6, 7, i + 8], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            lines = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
            results[i] = lines

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(f"{url}/ready").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        for i in range(5):
            data = [x for x in results[i] if x.startswith("data: ")]
            assert data[-1] == "data: [DONE]", results[i][-3:]
            assert f'"finish_reason": "{finish}"' in data[-2]
    finally:
        if proc.poll() is None:
            proc.kill()
