"""SIGTERM on a real `s5serve serve` process: readiness turns 503, new work gets 503, streams
in flight finish, and the process exits 0."""

import json
import signal
import threading
import time

import httpx
import pytest

from tests.servers import server_process


@pytest.mark.parametrize("grace,max_tokens,finish,streams", [(30, 400, "length", 50), (1, 4000, "abort", 5)])
def test_sigterm_drains_streams(tmp_path, grace, max_tokens, finish, streams):
    """Streams that finish within the grace period end normally; the rest end with a final
    event when it runs out (finish reason "abort"). Either way every stream ends with [DONE]."""
    with server_process(tmp_path / "log", "--model", "tiny-random:0", "--drain-grace", str(grace), "--rows", "64",
                        "--kv-cache-bytes", str(1 << 24)) as (proc, url):
        results, live = {}, []

        def stream(i):
            body = {"prompt": [5, 6, 7, i + 8], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            lines = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not lines:
                        live.append(i)  # streaming: its first event arrived
                    lines.append(line)
            results[i] = lines

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(live) < streams and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(live) == streams
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(f"{url}/ready").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        assert len(results) == streams
        for i in range(streams):
            data = [x for x in results[i] if x.startswith("data: ")]
            assert data[-1] == "data: [DONE]", results[i][-3:]
            assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == finish
